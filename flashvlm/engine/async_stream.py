"""The parts of `AsyncEngine` beside the stepping thread: a request's output slot and the async iterator over it,
the admission bound, and the errors the async engine raises."""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
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


class Admission:
    """The waiting bound. A request counts from `reserve` (before preprocessing) until the scheduler first runs
    it (and again while preempted), wherever it is meanwhile: being preprocessed (`preparing`), queued for the
    engine thread (`pending`), or in the scheduler's waiting queue (`engine_waiting`). Counts are by priority,
    so a policy can bound the requests ahead of a new one rather than the total. Thread-safe.

    `policy`: an object with `check(num_waiting, num_ahead) -> retry_after_s | None` (and optionally
    `record_finished(n)`), e.g. flashvlm.engine.sla.AdmissionController; without one, at most `max_waiting`
    requests wait in total and Retry-After comes from `estimate_retry(num_waiting)`.
    """

    def __init__(self, max_waiting: int, policy: Any, estimate_retry: Callable[[int], float]) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting}")
        self.max_waiting = max_waiting
        self.policy = policy
        self._estimate_retry = estimate_retry
        self._lock = threading.Lock()
        self._preparing: collections.Counter[int] = collections.Counter()
        self._pending: collections.Counter[int] = collections.Counter()
        self._engine_waiting: dict[int, int] = {}
        self.peak_queued = 0
        self.rejected = 0

    def _queued(self) -> int:
        return sum(self._preparing.values()) + sum(self._pending.values()) + sum(self._engine_waiting.values())

    def _ahead_of(self, priority: int) -> int:
        # Lower value = served first, so everything of this priority or lower is ahead of a newcomer.
        return sum(n for counts in (self._preparing, self._pending, self._engine_waiting)
                   for p, n in counts.items() if p <= priority)

    def _refuse_if_full(self, priority: int) -> None:
        queued = self._queued()
        if self.policy is not None:
            retry = self.policy.check(queued, self._ahead_of(priority))
        else:
            retry = self._estimate_retry(queued) if queued >= self.max_waiting else None
        if retry is not None:
            self.rejected += 1
            raise QueueFullError(float(retry), queued, self.max_waiting)

    def check(self, priority: int) -> None:
        with self._lock:
            self._refuse_if_full(priority)

    def reserve(self, priority: int) -> AdmissionSlot:
        with self._lock:
            self._refuse_if_full(priority)
            self._preparing[priority] += 1
            self.peak_queued = max(self.peak_queued, self._queued())
        return AdmissionSlot(priority, self._release)

    def _release(self, priority: int) -> None:
        with self._lock:
            self._preparing[priority] -= 1

    def submit(self, slot: AdmissionSlot) -> None:
        """The request behind `slot` is handed to the engine thread: preparing -> pending."""
        with self._lock:
            if not slot.active:
                raise RuntimeError("this admission slot was already used or released")
            slot.active = False
            self._preparing[slot.priority] -= 1
            self._pending[slot.priority] += 1

    def update_engine(self, waiting_by_priority: dict[int, int], applied: list[int]) -> None:
        """Engine thread: the scheduler's waiting counts now, and the priorities of the adds just applied. Both
        change in one locked update, so no reservation in between sees those requests missing from both."""
        with self._lock:
            self._engine_waiting = waiting_by_priority
            for priority in applied:
                self._pending[priority] -= 1

    def record_finished(self, n: int) -> None:
        if n and self.policy is not None and hasattr(self.policy, "record_finished"):
            self.policy.record_finished(n)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"num_queued": self._queued(), "peak_num_queued": self.peak_queued, "num_rejected": self.rejected,
                    "max_waiting_requests": self.max_waiting}
