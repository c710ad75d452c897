"""How `flashvlm serve` runs uvicorn: a graceful stop on SIGTERM and SIGINT, and a deadline on request heads.

uvicorn on its own re-raises the signal that stopped it once the drain is over, so the process died of it
(exit 143 on SIGTERM), and it waits forever for the head of a request that a client sends slowly or never
finishes; both are handled here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import h11
import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SHUTTING_DOWN = {"message": "the server is shutting down; the request was aborted", "type": "service_unavailable",
                  "param": None, "code": "server_shutting_down"}


class _HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 connection, closed when the head of a request (request line and headers) has not fully
    arrived within `head_timeout_s` of the connection opening or of its previous response. The deadline is not
    moved by the bytes that do arrive, so a client trickling a byte at a time is closed too."""

    head_timeout_s: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._cancel_head_timer()  # the head is complete: the body has its own timeout (the app's)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def head_deadline_protocol(head_timeout_s: float) -> type[H11Protocol]:
    """The connection class for uvicorn's `http` setting, with this head deadline."""
    if head_timeout_s <= 0:
        raise ValueError(f"--header-read-timeout must be positive, got {head_timeout_s}")
    return type("HeadDeadlineProtocol", (_HeadDeadlineProtocol,), {"head_timeout_s": float(head_timeout_s)})


class GracefulServer(uvicorn.Server):
    """uvicorn's server with its drain (stop listening, let running requests finish within
    `timeout_graceful_shutdown` seconds, then cancel what is left) and an ordinary return afterwards: the stop
    signal is not raised again. A second SIGINT during the drain cancels at once, as in uvicorn."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; an embedded server is stopped through should_exit
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            # os.write, not print: a signal handler that writes to a buffered stream the main thread was in the
            # middle of writing raises a reentrancy error.
            os.write(sys.stderr.fileno(), f"flashvlm: {signal.Signals(sig).name}: no new requests; finishing "
                     f"running ones (up to {self.config.timeout_graceful_shutdown} s)\n".encode())
        super().handle_exit(sig, frame)


class AnswerCutOffRequests:
    """Answer the requests that uvicorn cancels when the drain runs out (the only time it cancels one) instead of
    dropping their connections: a 503 if nothing was sent yet, an error event and `[DONE]` ending a stream. The
    handlers below have already aborted the engine's request by then (cancellation closes their generators)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = streaming = finished = False

        async def tracking_send(message: Message) -> None:
            nonlocal started, streaming, finished
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers", [])).get(b"content-type", b"")
                streaming = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except asyncio.CancelledError:
            if finished:
                raise
            await _answer_cut_off(send, started, streaming)  # then the request's task ends as a finished one


async def _answer_cut_off(send: Send, started: bool, streaming: bool) -> None:
    if not started:
        body = json.dumps({"error": _SHUTTING_DOWN}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
    elif streaming:
        body = f"data: {json.dumps({'error': _SHUTTING_DOWN})}\n\ndata: [DONE]\n\n".encode()
    else:
        body = b""
    await send({"type": "http.response.body", "body": body, "more_body": False})


def build_server(app: Any, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                 shutdown_timeout_s: float = 10.0, header_read_timeout_s: float = 10.0,
                 **config: Any) -> GracefulServer:
    """The server `flashvlm serve` runs (`server.run()`, or `server.run(sockets=[...])` on a bound socket)."""
    if shutdown_timeout_s < 0:
        raise ValueError(f"--shutdown-timeout must be 0 or more seconds, got {shutdown_timeout_s}")
    return GracefulServer(uvicorn.Config(AnswerCutOffRequests(app), host=host, port=port, log_level=log_level,
                                         timeout_graceful_shutdown=shutdown_timeout_s,  # type: ignore[arg-type]
                                         http=head_deadline_protocol(header_read_timeout_s), **config))
