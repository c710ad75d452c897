"""Preprocess a batch of prompts on a few threads while the engine runs, handing them over in order.

Image decode, hash and resize release the GIL, so a batch's preprocessing overlaps the engine's steps on the
first prompts instead of all of it running before the first step. Used by `LLM.generate` / `LLM.chat` and the
throughput benchmark.

Given the engine's backlog, only a window of prompts is preprocessed ahead of it: enough for AHEAD_STEPS of its
steps' prompt-token budget (at least WINDOW_FLOOR prompts). Preprocessing every prompt of a large batch at once
makes four busy threads contend with the engine's thread for the GIL while it launches its first steps: on one
H200 the first step of 512 offline 1008x756 requests took 1.3 s instead of about 0.15 s while 511 pictures were
preprocessed beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from flashvlm.processing.input_processor import ProcessedPrompt

PREPROCESS_THREADS = 4
"""Threads preprocessing a batch of prompts while the engine runs."""

WINDOW_FLOOR = 2 * PREPROCESS_THREADS
"""Fewest prompts kept preprocessing or waiting in the engine's queue, ahead of what it has started."""

AHEAD_STEPS = 3
"""Steps' worth of prompt tokens kept preprocessing or queued. A window of W prompts offers each step at least
W - (prompts a step takes), so it must hold two steps' worth for every step to be full; the third is margin for
prompts of unequal length."""

Job = Callable[[], ProcessedPrompt]
Backlog = Callable[[], tuple[int, int]]
"""The engine's waiting queue: (requests added and not started, their prompt tokens not yet computed)."""


class OrderedFeeder:
    """Runs `jobs` on up to PREPROCESS_THREADS threads (inline for a single job) and calls `add(k, result)` for
    job k in order, as each is ready. `result()` returns the job's prompt or raises its error, so the caller
    decides whether a bad prompt fails the batch or only itself. A context manager: leaving it cancels the
    jobs not yet started.

    With `backlog` and `step_tokens` (the engine's prompt-token budget a step), jobs start only while they and the
    engine's waiting queue number fewer than the window: AHEAD_STEPS x step_tokens over the mean prompt length
    waiting, at least WINDOW_FLOOR prompts. Without them every job starts at once."""

    def __init__(self, jobs: Sequence[Job], add: Callable[[int, Job], None], all_at_once: bool = False,
                 backlog: Backlog | None = None, step_tokens: int | None = None) -> None:
        """all_at_once: the first `feed` waits for every job and adds them all (callers with priorities, so the
        order among them holds from the first step); every job starts at once."""
        if (backlog is None) != (step_tokens is None):
            raise ValueError("backlog and step_tokens go together")
        self.jobs, self.add, self.all_at_once = list(jobs), add, all_at_once
        self.num_added = 0
        self._backlog = None if all_at_once else backlog
        self._step_tokens = step_tokens or 0
        self._window = WINDOW_FLOOR
        self._pool = ThreadPoolExecutor(max_workers=PREPROCESS_THREADS) if len(self.jobs) > 1 else None
        self._futures: list[Future] = []
        self._start_jobs(0)

    @property
    def done(self) -> bool:
        return self.num_added == len(self.jobs)

    @property
    def num_started(self) -> int:
        """Jobs handed to the threads so far (every job without a pool: they run inline, as they are added)."""
        return len(self.jobs) if self._pool is None else len(self._futures)

    @property
    def window(self) -> int:
        """Prompts kept preprocessing or queued ahead of the engine (every job without a backlog)."""
        return len(self.jobs) if self._backlog is None else self._window

    def _start_jobs(self, queued: int) -> None:
        if self._pool is None:
            return
        limit = min(len(self.jobs), self.num_added + max(self.window - queued, 0))
        while len(self._futures) < limit:
            self._futures.append(self._pool.submit(self.jobs[len(self._futures)]))

    def feed(self, block: bool) -> None:
        """Add every job whose result is ready, in order, then start more up to the window; `block`: wait for
        the next one first (the engine is idle)."""
        while not self.done:
            k = self.num_added
            if self._pool is None:
                result = self.jobs[k]
            else:
                if k == len(self._futures):  # the window is full of queued prompts, none in flight
                    if not block:
                        break
                    self._futures.append(self._pool.submit(self.jobs[k]))
                future = self._futures[k]
                if not (block or self.all_at_once or future.done()):
                    break
                result = future.result
            block = False
            self.num_added += 1
            self.add(k, result)
        if self._backlog is not None:
            queued, tokens = self._backlog()
            if queued and tokens:
                self._window = max(WINDOW_FLOOR, math.ceil(AHEAD_STEPS * self._step_tokens * queued / tokens))
            self._start_jobs(queued)

    def __enter__(self) -> OrderedFeeder:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
