"""Request handling behind the routes: validation, SLA tier, admission, preprocessing off the event loop, then a
streamed (SSE: streaming.py) or collected response. Metrics and traces are recorded when a request ends."""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from flashvlm.engine.async_engine import AsyncEngine
from flashvlm.processing.input_processor import ProcessedPrompt
from flashvlm.processing.prompt_pipeline import ImageBudgetError
from flashvlm.request import InvalidRequestError, RequestOutput
from flashvlm.server import limits, media
from flashvlm.server.admission import QueueFullError
from flashvlm.server.chat_output import assistant_message, chat_finish_reason
from flashvlm.server.logprobs import LogprobsFormatter
from flashvlm.server.outputs import finish_reason, response_usage
from flashvlm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    to_sampling_params,
)
from flashvlm.server.responses import (
    ChatChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionResponse,
)
from flashvlm.server.sse import SSEResponse
from flashvlm.server.streaming import Started, chat_events, completion_events

logger = logging.getLogger("flashvlm.server")


@dataclass
class ServerSettings:
    served_model_names: list[str]
    model_path: str | None = None
    media: media.MediaPolicy = field(default_factory=media.MediaPolicy)
    tiers: Any = None
    """A flashvlm.server.tiers.TierConfig, or None: then requests carry vLLM's `priority` and no tier."""
    api_key: str | None = None
    disable_log_requests: bool = False
    body_read_timeout_s: float = limits.DEFAULT_BODY_READ_TIMEOUT_S
    max_body_bytes_in_flight: int = limits.DEFAULT_MAX_BODY_BYTES_IN_FLIGHT
    enable_docs: bool = False
    """Serve /docs and /redoc: pages whose scripts the browser fetches from a CDN, so off unless asked for."""
    tool_call_parser: str = "hermes"
    """How calls are read out of a chat answer with tools (server/tool_calls.py:TOOL_CALL_PARSERS)."""


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, metrics: Any = None, tracer: Any = None) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.tracer = tracer
        self.logprobs = LogprobsFormatter(engine.engine.tokenizer)

    # ---- endpoints ----------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        st = await self._start(req, raw, lambda: self._prepare_chat(req))
        if req.stream:
            return SSEResponse(chat_events(st, req.tool_mode, self.logprobs, self._finish))
        final = await self._collect(st, raw)
        if final is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        messages = [assistant_message(c.text, req.tool_mode) for c in final.outputs]
        choices = [ChatChoice(index=c.index, message=m,
                              logprobs=None if c.logprobs is None else self.logprobs.chat(c.logprobs),
                              finish_reason=chat_finish_reason(finish_reason(c), bool(m.tool_calls)),
                              stop_reason=c.stop_reason) for c, m in zip(final.outputs, messages)]
        body = ChatCompletionResponse(id=f"chatcmpl-{st.base_id}", model=st.model, choices=choices,
                                      usage=response_usage(final))
        return JSONResponse(body.model_dump())

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        st = await self._start(req, raw, lambda: self.engine.process_prompt(req.engine_prompt()))
        if req.stream:
            return SSEResponse(completion_events(st, self.logprobs, self._finish))
        final = await self._collect(st, raw)
        if final is None:
            return Response(status_code=499)
        choices = [CompletionChoice(index=c.index, text=c.text,
                                    logprobs=None if c.logprobs is None else self.logprobs.completion(c.logprobs),
                                    finish_reason=finish_reason(c), stop_reason=c.stop_reason)
                   for c in final.outputs]
        body = CompletionResponse(id=f"cmpl-{st.base_id}", model=st.model, choices=choices, usage=response_usage(final))
        return JSONResponse(body.model_dump())

    # ---- admission and preprocessing ----------------------------------------------------------
    async def _start(self, req: ChatCompletionRequest | CompletionRequest, raw: Request,
                     prepare: Callable[[], Awaitable[ProcessedPrompt]]) -> Started:
        arrival = time.time()
        tier = "default"
        try:
            model = self._check_model(req.model)
            if isinstance(req, ChatCompletionRequest):
                req.check(self.settings.tool_call_parser)
            else:
                req.check()
            tier, priority = self._tier(req, raw)
            try:
                slot = self.engine.reserve(priority)
            except QueueFullError as e:
                raise APIError(429, str(e), "rate_limit_error", None, "queue_full",
                               {"Retry-After": str(e.retry_after_s)}) from None
            try:
                processed = await prepare()
                params = to_sampling_params(req, self.engine.default_sampling_params(),
                                            len(processed.prompt_token_ids), self.engine.max_model_len,
                                            self._kv_capacity_tokens())
                base_id, engine_id = self._request_ids(req, raw)
                stream = await self.engine.add_request(processed, params, request_id=engine_id, priority=priority,
                                                       tier=tier, arrival_time=arrival, slot=slot)
            finally:
                if slot is not None:
                    slot.release()
        except (APIError, InvalidRequestError) as e:
            if self.metrics is not None:
                status = e.status if isinstance(e, APIError) else 400
                self.metrics.reject(_REJECT_REASONS.get(status, "invalid"), tier)
            raise
        span = None
        if self.tracer is not None:
            from flashvlm.server.tracing import gen_ai_request_attributes

            attrs = {**gen_ai_request_attributes(model, params, req.stream), "flashvlm.engine_request_id": engine_id}
            span = self.tracer.start_request_span(base_id, raw.headers.get("traceparent"), attrs, start_time=arrival)
        if not self.settings.disable_log_requests:
            logger.info("request %s (engine id %s): tier=%s priority=%d prompt_tokens=%d images=%d max_tokens=%d "
                        "n=%d stream=%s", base_id, engine_id, tier, priority, len(processed.prompt_token_ids),
                        len(processed.mm_items), params.max_tokens, params.n, req.stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return Started(stream, base_id, model, tier, params, span, include_usage)

    @staticmethod
    def _request_ids(req: ChatCompletionRequest | CompletionRequest, raw: Request) -> tuple[str, str]:
        """(the id the client sees, the engine's key). A client's id (body `request_id` or `x-request-id`) is
        echoed as given, but clients reuse one id across requests (a trace id, a retry), and the engine needs a
        unique key: a short random suffix makes one that still starts with the client's id, for grepping logs."""
        client_id = req.request_id or raw.headers.get("x-request-id")
        if not client_id:
            return raw.state.request_id, raw.state.request_id  # assigned by the app: already unique
        raw.state.request_id = client_id
        return client_id, f"{client_id}-{secrets.token_hex(4)}"

    def _kv_capacity_tokens(self) -> int | None:
        """Tokens the engine's KV cache holds (usable blocks x block size); None if its stats do not say. Read from
        the stats snapshot the engine thread publishes, not from the block manager that thread owns."""
        num_blocks = self.engine.stats().get("kv_num_blocks")
        if num_blocks is None:
            return None
        return int(num_blocks) * self.engine.engine.config.cache.block_size

    def _check_model(self, model: str | None) -> str:
        names = self.settings.served_model_names
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {names}",
                           "invalid_request_error", "model", "model_not_found")
        return model

    def _tier(self, req: ChatCompletionRequest | CompletionRequest, raw: Request) -> tuple[str, int]:
        """(tier label, scheduler priority). A tier sets the priority unless the body gives `priority` itself."""
        name = req.sla_tier if req.sla_tier is not None else raw.headers.get("x-sla-tier")
        tiers = self.settings.tiers
        if tiers is None:
            if name is not None:
                raise bad_request("SLA tiers are not configured on this server (--sla-config)", "sla_tier")
            return "default", req.priority
        try:
            tier = tiers.resolve(name)
        except ValueError as e:
            raise bad_request(str(e), "sla_tier", "unknown_sla_tier") from None
        priority = req.priority if "priority" in req.model_fields_set else tier.priority
        return tier.name, priority

    async def _prepare_chat(self, req: ChatCompletionRequest) -> ProcessedPrompt:
        policy = self.settings.media
        messages = req.engine_messages()
        parts = media.image_parts(messages)
        media.check_image_count(len(parts), policy)
        for i, (part, url) in enumerate(parts):
            if media.is_remote(url):
                media.set_image_bytes(part, await media.fetch_remote_image(url, policy, i))
        videos = media.video_parts(messages)
        if videos:  # a local file is read, a data URI passed on: off the event loop
            await self.engine.run_in_executor(
                lambda: [media.set_video_source(part, policy, i) for i, part in enumerate(videos)])
        tools = list(req.tool_mode.tools) if req.tool_mode.renders_tools else None
        try:  # file reads, base64 and decoding run on the image pool, within the request's budget
            return await self.engine.process_chat(messages, req.mm_processor_kwargs,
                                                  load=functools.partial(media.load_source, policy=policy),
                                                  budget=policy.image_budget(), tools=tools)
        except jinja2.TemplateError as e:  # templates may refuse a conversation (raise_exception)
            raise bad_request(f"the chat template refused these messages: {e}", "messages") from None
        except ImageBudgetError as e:
            raise bad_request(f"{e} ({media.BUDGET_FLAGS[e.limit]})", "messages", "image_budget_exceeded") from None

    # ---- responses ----------------------------------------------------------------------------
    async def _collect(self, st: Started, raw: Request) -> RequestOutput | None:
        """The final output; None if the client went away first (the request is then aborted)."""

        async def consume() -> RequestOutput | None:
            async for out in st.stream:
                st.latest = out
            return st.latest

        task = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_wait_disconnect(raw))
        final: RequestOutput | None = None
        error: BaseException | None = None
        try:
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                final = task.result()  # raises the engine's error, if any
        except BaseException as e:
            error = e
            raise
        finally:
            gone.cancel()
            task.cancel()
            st.stream.close()
            self._finish(st, final, error)
        return final

    def _finish(self, st: Started, final: RequestOutput | None, error: BaseException | None) -> None:
        if self.metrics is not None:
            if final is not None:
                self.metrics.observe_finished(final, st.tier, st.stream.inter_token_latencies)
            elif error is None or isinstance(error, _CLIENT_GONE):  # the stream's close() aborted it in the engine
                self.metrics.observe_aborted(st.latest, st.tier)
        if st.span is not None and self.tracer is not None:
            reason = None if error is None else f"{type(error).__name__}: {error}"
            self.tracer.finish_request_span(st.span, final, st.tier, error=reason)
        if not self.settings.disable_log_requests:
            if final is not None:
                logger.info("request %s finished: %s, %d tokens", st.base_id,
                            ",".join(c.finish_reason or "" for c in final.outputs), final.num_output_tokens)
            else:
                logger.info("request %s ended early: %s", st.base_id, type(error).__name__ if error else "disconnect")

    def models(self) -> dict[str, Any]:
        from flashvlm.server.responses import ModelCard, ModelList

        root = self.settings.model_path or (str(Path(self.settings.served_model_names[0])))
        cards = [ModelCard(id=name, created=_START_TIME, root=root, max_model_len=self.engine.max_model_len)
                 for name in self.settings.served_model_names]
        return ModelList(data=cards).model_dump()


_START_TIME = int(time.time())
_REJECT_REASONS = {400: "invalid", 403: "forbidden", 404: "unknown_model", 429: "queue_full"}
# How a handler learns that its client went away: cancelled by the disconnect watcher, its SSE generator closed,
# or a write to the closed socket failing.
_CLIENT_GONE = (asyncio.CancelledError, GeneratorExit, OSError)


async def _wait_disconnect(raw: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (no polling).
    while (await raw.receive())["type"] != "http.disconnect":
        pass
