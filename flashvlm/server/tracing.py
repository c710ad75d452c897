"""Optional OpenTelemetry tracing: one span per request, a child span per pipeline stage, GenAI attributes.

Off by default. opentelemetry is an optional extra (`pip install flashvlm[tracing]`), so nothing here imports it at
module load: `Tracer.create` returns a no-op tracer when no endpoint is given or the packages are missing, and the
server never fails to start because of tracing.

The engine does not open spans while a request runs (that would put OpenTelemetry calls on the step loop's hot
path). The stage spans are reconstructed when the request finishes, from RequestOutput's timestamps and its
`stages` durations, which the engine measures anyway.

We use a private TracerProvider instead of the process-global one, so two servers (or tests) in one process never
share exporters.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from flashvlm.request import RequestOutput, SamplingParams

__all__ = ["Tracer", "RequestSpan", "gen_ai_request_attributes", "STAGE_ORDER"]

logger = logging.getLogger(__name__)

STAGE_ORDER: tuple[str, ...] = ("preprocess", "queue", "vision", "prefill", "decode", "detokenize")
"""Stages in the order they add up to E2E (Request.stage_times)."""

AttrValue = str | bool | int | float | list[str] | list[int] | list[float]


def _ns(t: float) -> int:
    return int(t * 1e9)


def gen_ai_request_attributes(model: str, sampling_params: SamplingParams | None = None,
                              stream: bool | None = None) -> dict[str, AttrValue]:
    """GenAI semantic-convention request attributes, for `start_request_span(attributes=...)`."""
    attrs: dict[str, AttrValue] = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model}
    if sampling_params is not None:
        sp = sampling_params
        attrs["gen_ai.request.max_tokens"] = sp.max_tokens
        attrs["gen_ai.request.temperature"] = float(sp.temperature)
        attrs["gen_ai.request.top_p"] = float(sp.top_p)
        if sp.top_k > 0:
            attrs["gen_ai.request.top_k"] = sp.top_k
        if sp.seed is not None:
            attrs["gen_ai.request.seed"] = sp.seed
        if sp.stop:
            attrs["gen_ai.request.stop_sequences"] = list(sp.stop)
        if sp.n != 1:
            attrs["gen_ai.request.choice.count"] = sp.n
    if stream is not None:
        attrs["gen_ai.request.stream"] = stream
    return attrs


@dataclass
class RequestSpan:
    """Handle of one request's root span; `span` is None when tracing is off."""

    request_id: str
    span: Any = None
    start_time: float = 0.0

    @property
    def recording(self) -> bool:
        return self.span is not None

    @property
    def trace_id(self) -> str | None:
        """32-hex trace id (what a traceparent header carries), None when tracing is off."""
        if self.span is None:
            return None
        return format(self.span.get_span_context().trace_id, "032x")


def _otlp_exporter(endpoint: str) -> Any:
    """OTLP exporter for the endpoint; honors OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc or http/protobuf)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                              os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    # The HTTP exporter posts to the URL as given; a bare collector address means its standard traces path.
    if urlparse(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint)


class Tracer:
    """Request tracing facade. Build with `Tracer.create`; a disabled one accepts every call and does nothing."""

    def __init__(self, otel_tracer: Any = None, provider: Any = None) -> None:
        self._tracer = otel_tracer
        self._provider = provider

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    @classmethod
    def create(cls, otlp_endpoint: str | None, service_name: str = "flashvlm", *,
               exporter: Any = None) -> Tracer:
        """Tracing to `otlp_endpoint`, or a no-op tracer when it is None or opentelemetry is not installed.

        `exporter`: a SpanExporter to use instead of OTLP (tests pass an InMemorySpanExporter); it is flushed
        span by span, whereas OTLP export is batched off the request path.
        """
        if otlp_endpoint is None and exporter is None:
            return cls()
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

            if exporter is not None:
                processor = SimpleSpanProcessor(exporter)
            else:
                assert otlp_endpoint is not None
                processor = BatchSpanProcessor(_otlp_exporter(otlp_endpoint))
        except ImportError as e:
            logger.warning("OpenTelemetry tracing requested but unavailable (%s); install flashvlm[tracing]. "
                           "Tracing is off.", e)
            return cls()
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(processor)
        return cls(provider.get_tracer("flashvlm"), provider)

    def start_request_span(self, request_id: str, traceparent: str | None = None,
                           attributes: Mapping[str, AttrValue] | None = None,
                           start_time: float | None = None) -> RequestSpan:
        """Open the root span of a request, as a child of the caller's span when `traceparent` (the W3C header
        value) is valid; an absent or malformed header starts a new trace. `start_time`: epoch seconds, default
        now. Attributes: usually `gen_ai_request_attributes(...)`."""
        t0 = time.time() if start_time is None else start_time
        if self._tracer is None:
            return RequestSpan(request_id, None, t0)
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        ctx = TraceContextTextMapPropagator().extract({"traceparent": traceparent}) if traceparent else None
        attrs = dict(attributes or {})
        model = attrs.get("gen_ai.request.model")
        operation = attrs.setdefault("gen_ai.operation.name", "chat")
        # GenAI convention for span names: "{operation} {model}".
        name = f"{operation} {model}" if model else str(operation)
        span = self._tracer.start_span(name, context=ctx, kind=SpanKind.SERVER, attributes=attrs,
                                       start_time=_ns(t0))
        span.set_attribute("flashvlm.request_id", request_id)
        return RequestSpan(request_id, span, t0)

    def finish_request_span(self, span: RequestSpan, output: RequestOutput | None, tier: str = "default",
                            error: str | None = None, end_time: float | None = None) -> None:
        """Record the outcome on the root span, add one child span per stage, and end it.

        `output` None (the request failed before the engine produced one) ends the span with only `error`.
        `end_time`: epoch seconds, default now (never before the output's finish time)."""
        root = span.span
        if root is None:
            return
        from opentelemetry.trace import Status, StatusCode, set_span_in_context

        root.set_attribute("flashvlm.sla.tier", tier)
        end = time.time() if end_time is None else end_time
        if output is not None:
            self._record_output(root, output)
            self._stage_spans(root, output, set_span_in_context(root))
            if output.finish_time is not None:
                end = max(end, output.finish_time)
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=_ns(max(end, span.start_time)))

    @staticmethod
    def _record_output(root: Any, output: RequestOutput) -> None:
        root.set_attribute("gen_ai.response.id", output.request_id)
        root.set_attribute("gen_ai.usage.input_tokens", len(output.prompt_token_ids))
        root.set_attribute("gen_ai.usage.output_tokens", output.num_output_tokens)
        root.set_attribute("gen_ai.usage.cache_read.input_tokens", output.num_cached_tokens)
        if output.finished:
            root.set_attribute("gen_ai.response.finish_reasons", [o.finish_reason for o in output.outputs])
        if output.ttft is not None:
            root.set_attribute("gen_ai.response.time_to_first_chunk", output.ttft)
        if output.finish_time is not None:
            root.set_attribute("flashvlm.latency.e2e_s", output.finish_time - output.arrival_time)

    def _stage_spans(self, root: Any, output: RequestOutput, ctx: Any) -> None:
        """Lay the stages end to end from arrival. Decode is pinned to the first-token instant when known, so
        rounding in the earlier stages cannot push it off the real timeline."""
        if not output.stages:
            return
        cursor = output.arrival_time
        for stage in STAGE_ORDER:
            seconds = output.stages.get(stage)
            if seconds is None:
                continue
            start = cursor
            if stage == "decode" and output.first_token_time is not None:
                start = max(cursor, output.first_token_time)
            end = start + max(0.0, seconds)
            child = self._tracer.start_span(f"flashvlm.{stage}", context=ctx, start_time=_ns(start),
                                            attributes={"flashvlm.stage": stage, "flashvlm.stage.seconds": seconds})
            child.end(end_time=_ns(end))
            cursor = end

    def shutdown(self) -> None:
        """Flush pending spans (batched OTLP export) and stop; call at server shutdown."""
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
            self._tracer = None
