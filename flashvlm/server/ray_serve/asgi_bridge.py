"""Run an ASGI app (flashvlm's server app) on a request that arrived as data rather than on a socket: the
ingress forwards what it read from the client, the engine replica replays it into its app and hands back the
response as it is sent (its start, then its body chunks), so streams flow through as they are produced.

The client's disconnect reaches the app as it does under uvicorn: when the caller stops reading (closes or
cancels the generator), the app's next `receive()` answers `http.disconnect`, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

_END = object()
HEAD_ITEMS = 2
"""Body items of a response that leave at once whatever the batching interval: a chat stream's role delta and its
first token, so batching never delays the time to first token."""
MAX_ITEM_BYTES = 1 << 20
"""The most body bytes one item carries (a larger chunk leaves in slices): an item is one message of Serve's gRPC
path, which caps messages at 4 MiB by default."""
APP_EXIT_GRACE_S = 5.0
"""How long a closed request's app may take to notice the disconnect and finish before it is cancelled."""


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def is_event_stream(self) -> bool:
        return (self.header(b"content-type") or b"").startswith(b"text/event-stream")


async def run_asgi(app: ASGIApp, request: ForwardedRequest, extra_headers: tuple[tuple[bytes, bytes], ...] = (),
                   batching_interval_s: float = 0.0) -> AsyncIterator[ResponseStart | bytes]:
    """Yield the app's ResponseStart (with `extra_headers` added), then its body: each item the non-empty chunks
    sent since the previous item was taken, joined (in slices of at most MAX_ITEM_BYTES). With
    `batching_interval_s`, after the first HEAD_ITEMS body items, an item leaves no sooner than that long after the
    previous one (or as soon as the response ends), carrying every chunk sent meanwhile."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[Any] = asyncio.Queue()
    finished = asyncio.Event()  # set with the _END in `out`
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    def end(*_: Any) -> None:
        out.put_nowait(_END)
        finished.set()

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the client is gone")  # what a write to a closed socket does under uvicorn
        if message["type"] == "http.response.start":
            out.put_nowait(ResponseStart(int(message["status"]), [*message.get("headers", []), *extra_headers]))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                out.put_nowait(bytes(message["body"]))
            if not message.get("more_body", False):
                end()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path,
             "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
             "headers": list(request.headers), "client": request.client, "server": None}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(end)
    body_items, last_sent = 0, -math.inf
    try:
        ended = False
        while not ended and (item := await out.get()) is not _END:
            if isinstance(item, bytes):
                # Each item costs a Ray message (two more behind Serve's HTTP proxy), which one per token would
                # saturate long before the engine: chunks sent within one interval, or while the caller was still
                # taking the last item, travel as one.
                body_items += 1
                wait = last_sent + batching_interval_s - loop.time()
                if body_items > HEAD_ITEMS and wait > 0:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(finished.wait(), wait)
                chunks = [item]
                while not out.empty():
                    if (more := out.get_nowait()) is _END:
                        ended = True
                        break
                    chunks.append(more)
                body = b"".join(chunks)
                last_sent = loop.time()
                for offset in range(0, len(body), MAX_ITEM_BYTES):
                    yield body[offset:offset + MAX_ITEM_BYTES]
                continue
            yield item
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_GRACE_S)
            task.cancel()
