"""Tracer: no-op without an endpoint or without opentelemetry; spans, stage children, GenAI attributes, traceparent."""

from __future__ import annotations

import sys

import pytest

from flashvlm.request import CompletionOutput, RequestOutput, SamplingParams
from flashvlm.server.tracing import Tracer, gen_ai_request_attributes

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


def _output() -> RequestOutput:
    # arrival 100.0; preprocess .1, queue .2 -> scheduled 100.3; vision .15, prefill .25 -> first token 100.7;
    # decode 1.2, detokenize .1 -> finish 102.0
    return RequestOutput(request_id="chatcmpl-1", prompt_token_ids=list(range(30)),
                         outputs=[CompletionOutput(0, list(range(8)), "hi", "length")],
                         arrival_time=100.0, first_token_time=100.7,
                         finish_time=102.0, num_cached_tokens=16,
                         stages={"preprocess": 0.1, "queue": 0.2, "vision": 0.15, "prefill": 0.25, "decode": 1.2,
                                 "detokenize": 0.1})


def _traced() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracer = Tracer.create(None, service_name="flashvlm-test", exporter=exporter)
    assert tracer.enabled
    return tracer, exporter


def test_disabled_without_endpoint_and_calls_are_noops() -> None:
    tracer = Tracer.create(None)
    assert not tracer.enabled
    span = tracer.start_request_span("r", TRACEPARENT, {"gen_ai.request.model": "m"})
    assert not span.recording and span.trace_id is None
    tracer.finish_request_span(span, _output(), tier="gold")
    tracer.shutdown()


def test_missing_opentelemetry_gives_noop_not_import_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes `import` raise ImportError, as if the extra were not installed.
    for name in ("opentelemetry.sdk", "opentelemetry.sdk.trace", "opentelemetry.sdk.resources"):
        monkeypatch.setitem(sys.modules, name, None)
    tracer = Tracer.create("http://localhost:4318")
    assert not tracer.enabled


def test_root_span_attributes_and_stage_children() -> None:
    tracer, exporter = _traced()
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8)
    span = tracer.start_request_span("chatcmpl-1", None, gen_ai_request_attributes("qwen2-vl", sp), start_time=99.9)
    tracer.finish_request_span(span, _output(), tier="gold", end_time=102.05)
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.parent is None]
    assert len(roots) == 1
    root = roots[0]
    assert root.name == "chat qwen2-vl"
    assert root.resource.attributes["service.name"] == "flashvlm-test"
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "qwen2-vl"
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.input_tokens"] == 30
    assert a["gen_ai.usage.output_tokens"] == 8
    assert a["gen_ai.usage.cache_read.input_tokens"] == 16
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.response.id"] == "chatcmpl-1"
    assert a["flashvlm.sla.tier"] == "gold"
    assert root.start_time == pytest.approx(99.9e9, abs=1e3)
    assert root.end_time == pytest.approx(102.05e9, abs=1e3)

    children = {s.name: s for s in spans if s.parent is not None}
    assert set(children) == {f"flashvlm.{st}" for st in
                             ("preprocess", "queue", "vision", "prefill", "decode", "detokenize")}
    for child in children.values():
        assert child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
    # Stages end to end from arrival; prefill ends and decode starts at the first token.
    expect = {"preprocess": (100.0, 100.1), "queue": (100.1, 100.3), "vision": (100.3, 100.45),
              "prefill": (100.45, 100.7), "decode": (100.7, 101.9), "detokenize": (101.9, 102.0)}
    for stage, (t0, t1) in expect.items():
        s = children[f"flashvlm.{stage}"]
        assert s.start_time == pytest.approx(t0 * 1e9, abs=1e3), stage
        assert s.end_time == pytest.approx(t1 * 1e9, abs=1e3), stage


def test_traceparent_continues_the_callers_trace() -> None:
    tracer, exporter = _traced()
    span = tracer.start_request_span("r", TRACEPARENT, {"gen_ai.request.model": "m"})
    assert span.trace_id == TRACE_ID
    tracer.finish_request_span(span, _output())
    spans = exporter.get_finished_spans()
    assert {format(s.context.trace_id, "032x") for s in spans} == {TRACE_ID}
    root = next(s for s in spans if s.name == "chat m")
    assert format(root.parent.span_id, "016x") == PARENT_SPAN_ID
    assert root.parent.is_remote


def test_malformed_traceparent_starts_a_new_trace() -> None:
    tracer, exporter = _traced()
    span = tracer.start_request_span("r", "garbage", {})
    tracer.finish_request_span(span, None, error="invalid image")
    (root,) = exporter.get_finished_spans()
    assert root.parent is None and format(root.context.trace_id, "032x") != TRACE_ID
    assert root.status.status_code.name == "ERROR"
    assert root.status.description == "invalid image"


def test_output_without_stages_gives_only_the_root_span() -> None:
    tracer, exporter = _traced()
    out = _output()
    out.stages = {}
    out.outputs[0].finish_reason = "abort"
    tracer.finish_request_span(tracer.start_request_span("r"), out, tier="bronze")
    (root,) = exporter.get_finished_spans()
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("abort",)


def test_decode_is_pinned_to_the_first_token_when_stages_do_not_add_up() -> None:
    tracer, exporter = _traced()
    out = _output()
    del out.stages["preprocess"]  # an engine that did not report it: earlier stages now end 0.1 s early
    tracer.finish_request_span(tracer.start_request_span("r"), out)
    decode = next(s for s in exporter.get_finished_spans() if s.name == "flashvlm.decode")
    assert decode.start_time == pytest.approx(100.7e9, abs=1e3)
