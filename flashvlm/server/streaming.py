"""The streamed (SSE) bodies of chat and text completions: per choice, text deltas that never take back what
was sent (held back against stop strings), log-probabilities, the finish event, usage, then [DONE]. An engine
failure becomes an error event."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from flashvlm.engine.async_engine import EngineDeadError, EngineStepError, RequestStream
from flashvlm.request import CompletionOutput, RequestOutput, SamplingParams, TokenLogprobs
from flashvlm.server.chat_output import ChatDeltas, chat_finish_reason
from flashvlm.server.logprobs import LogprobsFormatter
from flashvlm.server.outputs import finish_reason, response_usage, sse_event
from flashvlm.server.tool_protocol import ToolMode

Logprobs = list[TokenLogprobs] | None
"""The log-probabilities a stream event carries: its new tokens' (None when the request did not ask)."""


@dataclass
class Started:
    """A request the engine accepted."""

    stream: RequestStream
    base_id: str
    """The id the client sees (response id, x-request-id); the engine's key is `stream.request_id`."""
    model: str
    tier: str
    params: SamplingParams
    span: Any
    include_usage: bool
    latest: RequestOutput | None = None
    """The newest output read so far, for the metrics of a request the client abandoned."""

    @property
    def final(self) -> RequestOutput | None:
        """The finished output, once read: a request's stream ends with it, so it is the newest one."""
        return self.latest if self.latest is not None and self.latest.finished else None


OnEnd = Callable[[Started, RequestOutput | None, BaseException | None], None]
"""Called once when a stream ends: the request, its final output (None if it did not finish), the error if any."""


async def chat_events(st: Started, mode: ToolMode, formatter: LogprobsFormatter, on_end: OnEnd) -> AsyncIterator[str]:
    """A chat completion's SSE events: the role delta per choice, content (or tool call) deltas, each choice's
    finish, the usage chunk if asked for, then [DONE]."""
    rid, created = f"chatcmpl-{st.base_id}", int(time.time())
    extra = {"usage": None} if st.include_usage else {}
    choices = [ChatDeltas(mode) for _ in range(st.params.n)]

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, tokens: Logprobs = None) -> str:
        logprobs = None if tokens is None else formatter.chat(tokens)
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse_event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model,
                          "choices": [choice], **extra})

    def text_chunks(index: int, text: str, tokens: Logprobs) -> str:
        # The log-probabilities ride on the first delta, or on an empty one when a tag holds the text back.
        deltas = choices[index].feed(text) or ([{"content": ""}] if tokens is not None else [])
        return "".join(chunk(index, d, None, tokens if k == 0 else None) for k, d in enumerate(deltas))

    def last_chunks(c: CompletionOutput, tokens: Logprobs) -> str:
        rest = "".join(chunk(c.index, d) for d in choices[c.index].finish())
        reason = chat_finish_reason(finish_reason(c), choices[c.index].num_calls > 0)
        return rest + chunk(c.index, {}, reason, tokens)

    for index in range(st.params.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for piece in _deltas(st, text_chunks, last_chunks, on_end):
        if piece:
            yield piece
    if st.include_usage and st.final is not None:
        yield sse_event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": st.model,
                         "choices": [], "usage": response_usage(st.final).model_dump()})
    yield "data: [DONE]\n\n"


async def completion_events(st: Started, formatter: LogprobsFormatter, on_end: OnEnd) -> AsyncIterator[str]:
    """A text completion's SSE events: text deltas and each choice's finish, the usage chunk if asked for, then
    [DONE]."""
    rid, created = f"cmpl-{st.base_id}", int(time.time())
    extra = {"usage": None} if st.include_usage else {}

    # Per choice: characters of the token texts sent so far, where its next chunk's offsets start.
    text_offset = [0] * st.params.n

    def chunk(index: int, text: str, finish: str | None = None, tokens: Logprobs = None) -> str:
        logprobs = None if tokens is None else formatter.completion(tokens, text_offset[index])
        if logprobs is not None:
            text_offset[index] += LogprobsFormatter.text_length(logprobs)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return sse_event({"id": rid, "object": "text_completion", "created": created, "model": st.model,
                          "choices": [choice], **extra})

    async for piece in _deltas(st, lambda i, text, tokens: chunk(i, text, None, tokens),
                               lambda c, tokens: chunk(c.index, "", finish_reason(c), tokens), on_end):
        yield piece
    if st.include_usage and st.final is not None:
        yield sse_event({"id": rid, "object": "text_completion", "created": created, "model": st.model,
                         "choices": [], "usage": response_usage(st.final).model_dump()})
    yield "data: [DONE]\n\n"


async def _deltas(st: Started, content: Callable[[int, str, Logprobs], str],
                  last: Callable[[CompletionOutput, Logprobs], str], on_end: OnEnd) -> AsyncIterator[str]:
    """Per choice (completion index), text deltas as SSE events, then its finish event once that completion
    ends; an engine failure becomes an error event. Each event carries the log-probabilities of its choice's
    tokens that arrived since the last one (None unless asked for)."""
    # The engine's cumulative text may still lose its tail to a stop string a later token completes;
    # holding back that many characters means nothing streamed is ever taken back.
    holdback = max((len(s) for s in st.params.stop), default=1) - 1
    n = st.params.n
    sent, sent_tokens, ended = [0] * n, [0] * n, [False] * n
    final: RequestOutput | None = None
    error: BaseException | None = None
    try:
        async for out in st.stream:
            st.latest = out
            for c in out.outputs:
                i = c.index
                if ended[i]:
                    continue
                text = c.text
                end = len(text) if c.finished else max(sent[i], len(text) - holdback)
                if end > sent[i]:
                    tokens = None if c.logprobs is None else c.logprobs[sent_tokens[i]:]
                    sent_tokens[i] = len(c.token_ids)
                    yield content(i, text[sent[i]:end], tokens)
                    sent[i] = end
                if c.finished:
                    ended[i] = True
                    yield last(c, None if c.logprobs is None else c.logprobs[sent_tokens[i]:] or None)
            if out.finished:
                final = out
    except (EngineStepError, EngineDeadError) as e:
        error = e
        yield sse_event({"error": {"message": str(e), "type": "server_error", "param": None,
                                   "code": "engine_error"}})
    except BaseException as e:  # cancelled: the client went away
        error = e
        raise
    finally:
        st.stream.close()
        on_end(st, final, error)
