"""Reading request bodies with bounds: a per-request size, a wait for each piece of the body, and one budget of
body bytes held across all requests, so slow or stalled uploads cannot pile up memory."""

from __future__ import annotations

import asyncio

from starlette.types import Message, Receive


class BodyRefused(Exception):
    """A body that is not read to its end; `status` and `code` are the answer's."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class BodyBudget:
    """Bytes of request bodies the server holds, summed over every request, from the first byte read until the
    request's handler returns; a request that would pass `limit_bytes` is refused (503). Used from the event
    loop's thread only."""

    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"--max-body-bytes-in-flight must be positive, got {limit_bytes}")
        self.limit_bytes = limit_bytes
        self.held_bytes = 0

    def take(self, nbytes: int) -> None:
        if self.held_bytes + nbytes > self.limit_bytes:
            raise BodyRefused(503, "server_busy", f"request bodies in flight would pass the server's limit of "
                                                  f"{self.limit_bytes} bytes; retry shortly")
        self.held_bytes += nbytes

    def give_back(self, nbytes: int) -> None:
        self.held_bytes -= nbytes


class BodyReader:
    """One request's body, read whole with its bytes taken from the budget as they arrive (all of a declared
    Content-Length at once, before reading); `release()` gives them back."""

    def __init__(self, budget: BodyBudget, max_bytes: int, timeout_s: float) -> None:
        self.budget = budget
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.held_bytes = 0

    def _take(self, nbytes: int) -> None:
        self.budget.take(nbytes)
        self.held_bytes += nbytes

    def release(self) -> None:
        self.budget.give_back(self.held_bytes)
        self.held_bytes = 0

    async def read(self, receive: Receive, declared_length: int | None) -> bytes | None:
        """The body, or None when the client left before sending it all. Raises BodyRefused: 413 past
        `max_bytes`, 408 when no piece arrives for `timeout_s` seconds, 503 when the budget is spent."""
        if declared_length is not None:
            self._take(declared_length)
        parts: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except asyncio.TimeoutError:
                raise BodyRefused(408, "request_timeout", f"the request body stalled: no bytes for "
                                                          f"{self.timeout_s:g} s") from None
            if message["type"] == "http.disconnect":
                return None
            part = message.get("body", b"")
            size += len(part)
            if size > self.max_bytes:
                raise BodyRefused(413, "request_too_large", f"the body is larger than the limit of "
                                                            f"{self.max_bytes} bytes")
            if size > self.held_bytes:
                self._take(size - self.held_bytes)
            parts.append(part)
            if not message.get("more_body", False):
                return b"".join(parts)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the whole body in one message and afterwards passes through (the handlers
    listen on it for the client's disconnect)."""
    pending: Message | None = {"type": "http.request", "body": body, "more_body": False}

    async def replay() -> Message:
        nonlocal pending
        if pending is not None:
            message, pending = pending, None
            return message
        return await receive()

    return replay
