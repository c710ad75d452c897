"""The pieces of `AsyncEngine` that live on the event loop side: a request's output slot and the async iterator
over it, admission slots and counters, and the errors the async engine raises."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashvlm.request import RequestOutput

ACCEPTED = object()
"""Pushed to a request's slot once the engine thread has added it."""


class QueueFullError(RuntimeError):
    """Admission control refused a request: too many are already waiting. Retry after `retry_after_s`."""

    def __init__(self, retry_after_s: float, num_waiting: int, limit: int) -> None:
        super().__init__(f"the server is overloaded: {num_waiting} requests are waiting (limit {limit}); "
                         f"retry after {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s
        self.num_waiting = num_waiting
        self.limit = limit


class EngineStepError(RuntimeError):
    """The engine failed while running a step that held this request; other requests carry on."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a fatal error); no request can be served."""



class OutputSlot:
    """Loop-side state of one request. Written only on its event loop (pushes arrive via call_soon_threadsafe)."""

    __slots__ = ("request_id", "loop", "tier", "event", "latest", "error", "accepted", "done", "token_times")

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, tier: str | None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.tier = tier
        self.event = asyncio.Event()
        self.latest: RequestOutput | None = None
        self.error: BaseException | None = None
        self.accepted = False
        self.done = False
        self.token_times: list[float] = []
        """Wall time at which each output token left the engine (for inter-token latency)."""

    def push(self, item: Any, t: float) -> None:
        if item is ACCEPTED:
            self.accepted = True
        elif isinstance(item, BaseException):
            self.error = item
        else:
            new = len(item.token_ids) - len(self.token_times)
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

    @property
    def request_id(self) -> str:
        return self._s.request_id

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


class AdmissionSlot:
    """A reserved place among the waiting requests (see AsyncEngine.reserve)."""

    def __init__(self, priority: int, release: Callable[[int], None]) -> None:
        self.priority = priority
        self.active = True
        self._release = release

    def release(self) -> None:
        """Give the place back unless add_request consumed it. Idempotent."""
        if self.active:
            self.active = False
            self._release(self.priority)


@dataclass
class Counters:
    """Admission bookkeeping by priority, guarded by AsyncEngine._lock. A request counts from admission until
    the scheduler first runs it (and again while preempted), wherever it is meanwhile."""

    preparing: collections.Counter = field(default_factory=collections.Counter)
    """Admitted requests still being preprocessed on the loop side."""
    pending: collections.Counter = field(default_factory=collections.Counter)
    """Adds queued for the engine thread, not yet applied."""
    engine_waiting: dict[int, int] = field(default_factory=dict)
    """The scheduler's waiting queue by priority, as of the engine thread's last look."""
    peak_queued: int = 0
    rejected: int = 0

    @property
    def queued(self) -> int:
        return sum(self.preparing.values()) + sum(self.pending.values()) + sum(self.engine_waiting.values())

    def ahead_of(self, priority: int) -> int:
        """Queued requests served no later than a new one of this priority (lower value = served first)."""
        return sum(n for counts in (self.preparing, self.pending, self.engine_waiting)
                   for p, n in counts.items() if p <= priority)
