"""The parts of `AsyncEngine` beside the stepping thread: a request's output slot and the async iterator over it,
the interface of an admission bound (the server's is flashvlm.server.admission.Admission), and the errors the
async engine raises."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from flashvlm.request import RequestOutput

ACCEPTED = object()
"""Pushed to a request's slot once the engine thread has added it."""


class EngineStepError(RuntimeError):
    """The engine failed while running a step that held this request; other requests carry on."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a fatal error); no request can be served."""


class AdmissionTicket(Protocol):
    """A place a request holds among the waiting requests, from before its preprocessing."""

    priority: int

    def submit(self) -> None:
        """The request is handed to the engine thread."""

    def release(self) -> None:
        """The request was dropped before that (no-op once submitted)."""


class AdmissionGate(Protocol):
    """A bound on waiting requests that AsyncEngine keeps informed. `reserve` raises to refuse a request;
    `update_engine` and `record_finished` are called on the engine thread."""

    def reserve(self, priority: int) -> AdmissionTicket: ...

    def update_engine(self, waiting_by_priority: dict[int, int], applied: list[int]) -> None:
        """The scheduler's waiting counts by priority now, and the priorities of the adds just applied."""

    def record_finished(self, n: int) -> None: ...

    def stats(self) -> dict[str, int]: ...


class OutputSlot:
    """Loop-side state of one request. Written only on its event loop (pushes arrive via call_soon_threadsafe)."""

    __slots__ = ("request_id", "loop", "event", "latest", "error", "accepted", "done", "token_times")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.event = asyncio.Event()
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.accepted = False
        self.done = False
        self.token_times: list[float] = []
        """Wall time at which each output token left the engine (for inter-token latency); with n completions, each
        step of the longest one (the samples decode side by side, so their tokens of one step share a time)."""

    def push(self, item: Any, t: float) -> None:
        if item is ACCEPTED:
            self.accepted = True
        elif isinstance(item, BaseException):
            self.error = item
        else:
            new = max(len(o.token_ids) for o in item.outputs) - len(self.token_times)
            if new > 0:
                self.token_times.extend([t] * new)
            self.latest = item
        self.event.set()


class RequestStream:
    """Async iterator over one accepted request's outputs. Leaving it early (`close`, `async with`, or
    a cancelled consumer) aborts the request in the engine so its KV blocks are freed."""

    def __init__(self, stream: OutputSlot, abort: Callable[[str], None]) -> None:
        self._s = stream
        self._abort = abort
        self.request_id = stream.request_id

    @property
    def finished(self) -> bool:
        return self._s.done

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self._s.token_times
        return [b - a for a, b in zip(t, t[1:])]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        s = self._s
        while True:
            if s.latest is not None:
                out, s.latest = s.latest, None
                if out.finished:
                    s.done = True
                return out
            if s.error is not None:
                s.done = True
                raise s.error
            if s.done:
                raise StopAsyncIteration
            s.event.clear()
            await s.event.wait()

    def close(self) -> None:
        """Abort the request unless it has finished. Safe to call more than once."""
        if not self._s.done:
            self._s.done = True
            self._abort(self._s.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
