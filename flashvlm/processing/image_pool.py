"""Threads that load, decode and resize request images, shared fairly between requests.

Each request works through its own `ImageSession`. Workers take jobs round-robin across the sessions that have
some waiting, and one session never has more than `per_request` jobs running at once: a request of twelve huge
images cannot hold every worker, and a request that arrives behind it gets the next free worker for its first
image instead of waiting for all twelve. Text work never comes here (flashvlm/processing/prompt_pipeline.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

MAX_AUTO_THREADS = 32
WORKER_NICENESS = 10
"""How much lower than the server's other threads image workers run (Linux, where a thread has its own nice
value): when CPUs are short, the engine's stepping thread and text work win them, and images take what is left."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers narrow), not the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_image_threads() -> int:
    """Half the usable CPUs (at least 1, at most MAX_AUTO_THREADS): the other half stays with the engine's
    stepping thread, tokenization and the event loop, which text-only requests need."""
    return max(1, min(MAX_AUTO_THREADS, usable_cpus() // 2))


def default_share(threads: int) -> int:
    """Jobs of one request running at once: half the workers (at least 1), so another request always finds one."""
    return max(1, threads // 2)


def check_pool_sizes(threads: int | None, per_request: int | None) -> None:
    """`flashvlm serve --image-decode-threads` and `--image-decodes-per-request` (None: sized from the machine)."""
    for flag, value in (("--image-decode-threads", threads), ("--image-decodes-per-request", per_request)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")


class ImagePool:
    """`threads` daemon workers; `per_request`: most jobs of one session running at once."""

    def __init__(self, threads: int | None = None, per_request: int | None = None) -> None:
        check_pool_sizes(threads, per_request)
        self.threads = default_image_threads() if threads is None else threads
        self.per_request = default_share(self.threads) if per_request is None else per_request
        self._cond = threading.Condition()
        self._ring: deque[ImageSession] = deque()
        """Sessions with jobs waiting, in the order workers serve them."""
        self._stopped = False
        self._running = 0
        self._workers = [threading.Thread(target=self._work, name=f"flashvlm-image-{i}", daemon=True)
                         for i in range(self.threads)]
        for worker in self._workers:
            worker.start()

    def session(self) -> ImageSession:
        """One request's share of the pool; close it (or leave its `with` block) when the request is done."""
        return ImageSession(self)

    def shutdown(self) -> None:
        """Cancel every waiting job and let the workers exit after their current one."""
        with self._cond:
            self._stopped = True
            for session in self._ring:
                session._cancel_waiting()
            self._ring.clear()
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        """Image jobs held by workers now, and queued behind them."""
        with self._cond:
            return {"image_jobs_running": self._running,
                    "image_jobs_waiting": sum(len(s._waiting) for s in self._ring)}

    # ---- used by sessions and workers (under self._cond) -----------------------------------
    def _enqueue(self, session: ImageSession, future: Future, fn: Callable[[], Any]) -> None:
        with self._cond:
            if self._stopped:
                future.cancel()
                return
            session._waiting.append((future, fn))
            if session not in self._ring:
                self._ring.append(session)
            self._cond.notify()

    def _drop(self, session: ImageSession) -> None:
        with self._cond:
            session._cancel_waiting()
            if session in self._ring:
                self._ring.remove(session)

    def _next_job(self) -> tuple[ImageSession, Future, Callable[[], Any]] | None:
        """The next job round-robin among sessions under their share; None once the pool is shut down."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                for session in self._ring:
                    if session.running < self.per_request:
                        self._ring.remove(session)
                        future, fn = session._waiting.popleft()
                        if session._waiting:
                            self._ring.append(session)  # its next job waits for the other sessions' turns
                        session.running += 1
                        self._running += 1
                        return session, future, fn
                self._cond.wait()

    def _work(self) -> None:
        _lower_priority()
        while (job := self._next_job()) is not None:
            session, future, fn = job
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # the caller reads it from the future
                        future.set_exception(e)
            finally:
                with self._cond:
                    session.running -= 1
                    self._running -= 1
                    self._cond.notify_all()


class ImageSession:
    """The jobs of one request. `running`: how many of them workers hold now."""

    def __init__(self, pool: ImagePool) -> None:
        self.pool = pool
        self.running = 0
        self._waiting: deque[tuple[Future, Callable[[], Any]]] = deque()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self.pool._enqueue(self, future, fn)
        return future

    def close(self) -> None:
        """Cancel the jobs not started yet; running ones finish and their results are dropped."""
        self.pool._drop(self)

    def _cancel_waiting(self) -> None:
        while self._waiting:
            self._waiting.popleft()[0].cancel()

    def __enter__(self) -> ImageSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lower_priority() -> None:
    # Not Linux, or not allowed: the workers run at the server's priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0)
                       + WORKER_NICENESS)
