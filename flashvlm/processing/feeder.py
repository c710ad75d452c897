"""Preprocess a batch of prompts on a few threads while the engine runs, handing them over in order.

Image decode, hash and resize release the GIL, so a batch's preprocessing overlaps the engine's steps on the
first prompts instead of all of it running before the first step. Used by `LLM.generate` / `LLM.chat` and the
throughput benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from flashvlm.processing.input_processor import ProcessedPrompt

PREPROCESS_THREADS = 4
"""Threads preprocessing a batch of prompts while the engine runs."""

Job = Callable[[], ProcessedPrompt]


class OrderedFeeder:
    """Runs `jobs` on up to PREPROCESS_THREADS threads (inline for a single job) and calls `add(k, result)` for
    job k in order, as each is ready. `result()` returns the job's prompt or raises its error, so the caller
    decides whether a bad prompt fails the batch or only itself. A context manager: leaving it cancels the
    jobs not yet started."""

    def __init__(self, jobs: Sequence[Job], add: Callable[[int, Job], None], all_at_once: bool = False) -> None:
        """all_at_once: the first `feed` waits for every job and adds them all (callers with priorities, so the
        order among them holds from the first step)."""
        self.jobs, self.add, self.all_at_once = list(jobs), add, all_at_once
        self.num_added = 0
        self._pool = ThreadPoolExecutor(max_workers=PREPROCESS_THREADS) if len(self.jobs) > 1 else None
        self._futures = [self._pool.submit(job) for job in self.jobs] if self._pool is not None else None

    @property
    def done(self) -> bool:
        return self.num_added == len(self.jobs)

    def feed(self, block: bool) -> None:
        """Add every job whose result is ready, in order; `block`: wait for the next one first (the engine is
        idle)."""
        while not self.done:
            k = self.num_added
            if self._futures is None:
                result = self.jobs[k]
            else:
                future = self._futures[k]
                if not (block or self.all_at_once or future.done()):
                    return
                result = future.result
            block = False
            self.num_added += 1
            self.add(k, result)

    def __enter__(self) -> OrderedFeeder:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
