"""Admission control: the bound on waiting requests, and the Retry-After a refused request gets. Plain Python (no
torch); the server reserves a place before preprocessing, and `AsyncEngine` reports the engine's side."""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable

__all__ = ["Admission", "AdmissionSlot", "QueueFullError"]


class QueueFullError(RuntimeError):
    """Admission refused a request: too many are already waiting. Retry after `retry_after_s` whole seconds."""

    def __init__(self, retry_after_s: int, num_waiting: int, limit: int) -> None:
        super().__init__(f"the server is overloaded: {num_waiting} requests are waiting (limit {limit}); "
                         f"retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s
        self.num_waiting = num_waiting
        self.limit = limit


class AdmissionSlot:
    """A reserved place among the waiting requests (see Admission.reserve). AsyncEngine.add_request submits it
    when it hands the request to the engine thread; whoever dropped the request releases it."""

    def __init__(self, priority: int, admission: Admission) -> None:
        self.priority = priority
        self.active = True
        self._admission = admission

    def submit(self) -> None:
        """The request is handed to the engine thread: it now counts as queued there until the thread adds it."""
        if not self.active:
            raise RuntimeError("this admission slot was already used or released")
        self.active = False
        self._admission._submitted(self.priority)

    def release(self) -> None:
        """Give the place back unless `submit` consumed it. Idempotent."""
        if self.active:
            self.active = False
            self._admission._released(self.priority)


class Admission:
    """The one waiting bound and its Retry-After. Thread-safe.

    A request counts from `reserve` (before preprocessing) until the scheduler first runs it (and again while
    preempted), wherever it is meanwhile: being preprocessed (`preparing`), queued for the engine thread
    (`pending`), or in the scheduler's waiting queue (`engine_waiting`, reported by the engine thread through
    `update_engine`). Counts are by priority, so the bound applies to the requests ahead of a newcomer (its
    own priority and better: lower values are served first): a gold request is not refused because bronze filled
    the queue. Admitted while fewer than `max_waiting` are ahead and fewer than `hard_max_waiting` (default
    2 x max_waiting) wait in total; with one priority the bound is exactly `max_waiting`.

    Retry-After is the time the requests ahead need to drain at the recent completion rate (requests finished
    per second over `window_s`, from `record_finished`): by then the queue the client saw has been served.
    Clamped to [min_retry_s, max_retry_s]; with no completion in the window it is max_retry_s.
    """

    def __init__(self, max_waiting: int, *, hard_max_waiting: int | None = None, window_s: float = 30.0,
                 min_retry_s: int = 1, max_retry_s: int = 30, clock: Callable[[], float] = time.monotonic) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if not 1 <= min_retry_s <= max_retry_s:
            raise ValueError(f"need 1 <= min_retry_s <= max_retry_s, got {min_retry_s}, {max_retry_s}")
        self.max_waiting = max_waiting
        self.hard_max_waiting = hard_max_waiting if hard_max_waiting is not None else 2 * max_waiting
        if self.hard_max_waiting < max_waiting:
            raise ValueError("hard_max_waiting must be >= max_waiting")
        self.window_s = window_s
        self.min_retry_s = min_retry_s
        self.max_retry_s = max_retry_s
        self._clock = clock
        self._lock = threading.Lock()
        self._finished: collections.deque[tuple[float, int]] = collections.deque()
        self._preparing: collections.Counter[int] = collections.Counter()
        self._pending: collections.Counter[int] = collections.Counter()
        self._engine_waiting: dict[int, int] = {}
        self.peak_queued = 0
        """Most requests ever counted against the bound at once."""
        self.rejected = 0

    # ---- the rule ------------------------------------------------------------------------------
    def retry_after(self, num_waiting: int, num_ahead: int | None = None) -> int | None:
        """None = admit a request that finds `num_waiting` waiting, `num_ahead` of them served before it (default:
        all); otherwise the Retry-After in whole seconds."""
        with self._lock:
            return self._retry_after(num_waiting, num_ahead)

    def throughput(self) -> float | None:
        """Requests finished per second over the recent window; None when none finished within it."""
        with self._lock:
            return self._throughput()

    def record_finished(self, n: int = 1) -> None:
        """Count n requests finished now (once per finished request, or once per step with the count)."""
        if n > 0:
            with self._lock:
                self._finished.append((self._clock(), n))

    def _retry_after(self, num_waiting: int, num_ahead: int | None) -> int | None:
        ahead = num_waiting if num_ahead is None else num_ahead
        if ahead < self.max_waiting and num_waiting < self.hard_max_waiting:
            return None
        rate = self._throughput()
        if rate is None:
            return self.max_retry_s
        return int(min(self.max_retry_s, max(self.min_retry_s, math.ceil(max(ahead, 1) / rate))))

    def _throughput(self) -> float | None:
        now = self._clock()
        while self._finished and self._finished[0][0] < now - self.window_s:
            self._finished.popleft()
        if not self._finished:
            return None
        count = sum(n for _, n in self._finished)
        # Span from the oldest kept completion, so a burst after an idle period is not diluted over the whole
        # window; at least 1 s so two completions a microsecond apart do not read as a huge rate.
        span = min(self.window_s, max(1.0, now - self._finished[0][0]))
        return count / span

    # ---- the counts ----------------------------------------------------------------------------
    def reserve(self, priority: int) -> AdmissionSlot:
        """Take a place for a request of this priority, or raise QueueFullError."""
        with self._lock:
            queued = self._queued()
            retry = self._retry_after(queued, self._ahead_of(priority))
            if retry is not None:
                self.rejected += 1
                raise QueueFullError(retry, queued, self.max_waiting)
            self._preparing[priority] += 1
            self.peak_queued = max(self.peak_queued, queued + 1)
        return AdmissionSlot(priority, self)

    def update_engine(self, waiting_by_priority: dict[int, int], applied: list[int]) -> None:
        """Engine thread: the scheduler's waiting counts now, and the priorities of the adds just applied. Both
        change in one locked update, so no reservation in between sees those requests missing from both."""
        with self._lock:
            self._engine_waiting = waiting_by_priority
            for priority in applied:
                self._pending[priority] -= 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"num_queued": self._queued(), "peak_num_queued": self.peak_queued, "num_rejected": self.rejected,
                    "max_waiting_requests": self.max_waiting}

    def _submitted(self, priority: int) -> None:
        with self._lock:
            self._preparing[priority] -= 1
            self._pending[priority] += 1

    def _released(self, priority: int) -> None:
        with self._lock:
            self._preparing[priority] -= 1

    def _queued(self) -> int:
        return sum(self._preparing.values()) + sum(self._pending.values()) + sum(self._engine_waiting.values())

    def _ahead_of(self, priority: int) -> int:
        # Lower value = served first, so everything of this priority or better is ahead of a newcomer.
        return sum(n for counts in (self._preparing, self._pending, self._engine_waiting)
                   for p, n in counts.items() if p <= priority)
