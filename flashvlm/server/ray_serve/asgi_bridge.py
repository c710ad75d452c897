"""Run an ASGI app (flashvlm's server app) on a request that arrived as data rather than on a socket: the
ingress forwards what it read from the client, the engine replica replays it into its app and hands back the
response as it is sent (its start, then its body chunks), so streams flow through as they are produced.

The client's disconnect reaches the app as it does under uvicorn: when the caller stops reading (closes or
cancels the generator), the app's next `receive()` answers `http.disconnect`, which aborts the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message

_END = object()
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


async def run_asgi(app: ASGIApp, request: ForwardedRequest,
                   extra_headers: tuple[tuple[bytes, bytes], ...] = ()) -> AsyncIterator[ResponseStart | bytes]:
    """Yield the app's ResponseStart (with `extra_headers` added), then its non-empty body chunks."""
    out: asyncio.Queue[Any] = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise OSError("the client is gone")  # what a write to a closed socket does under uvicorn
        if message["type"] == "http.response.start":
            out.put_nowait(ResponseStart(int(message["status"]), [*message.get("headers", []), *extra_headers]))
        elif message["type"] == "http.response.body":
            if message.get("body"):
                out.put_nowait(bytes(message["body"]))
            if not message.get("more_body", False):
                out.put_nowait(_END)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path,
             "raw_path": request.path.encode(), "query_string": request.query_string, "root_path": "",
             "headers": list(request.headers), "client": request.client, "server": None}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: out.put_nowait(_END))
    try:
        while (item := await out.get()) is not _END:
            yield item
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_GRACE_S)
            task.cancel()
