"""OrderedFeeder: prompts handed over in order, and with a backlog only a window of them preprocessed ahead of
the engine (AHEAD_STEPS steps' prompt tokens, at least WINDOW_FLOOR prompts), which still fills every step."""

from __future__ import annotations

import math
import threading
import time

import pytest

from flashvlm.processing.feeder import AHEAD_STEPS, WINDOW_FLOOR, OrderedFeeder

STEP_TOKENS = 8192


class FakeEngine:
    """A waiting queue of prompts of `tokens` tokens each, which each step drains by as many as its budget
    holds."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.queue: list[int] = []
        self.started: list[int] = []

    def add(self, k: int, result) -> None:
        assert result() == k * k
        self.queue.append(k)

    def backlog(self) -> tuple[int, int]:
        return len(self.queue), len(self.queue) * self.tokens

    @property
    def per_step(self) -> int:
        return max(1, STEP_TOKENS // self.tokens)

    def step(self) -> None:
        self.started += self.queue[:self.per_step]
        del self.queue[:self.per_step]


def jobs(n: int, ran: list[int] | None = None):
    lock = threading.Lock()

    def job(k: int) -> int:
        if ran is not None:
            with lock:
                ran.append(k)
        return k * k

    return [lambda k=k: job(k) for k in range(n)]


def drain(feeder: OrderedFeeder, engine: FakeEngine, ahead: list[int], queued: list[int]) -> None:
    """Feed and step until every prompt ran, recording after each feed the prompts ahead of the engine (started
    or queued) and those it could take. Jobs started are let finish before each feed (a step is much longer
    than a prompt's preprocessing), so what is ready does not depend on thread timing."""
    while not feeder.done or engine.queue:
        while not all(f.done() for f in feeder._futures):
            time.sleep(0.0005)
        feeder.feed(block=not engine.queue)
        ahead.append(feeder.num_started - feeder.num_added + len(engine.queue))
        queued.append(len(engine.queue))
        engine.step()


@pytest.mark.parametrize("tokens", [16384, 4000, 1036, 320, 40])
def test_a_backlog_keeps_a_window_ahead_of_the_engine_that_fills_every_step(tokens: int) -> None:
    n = 300
    engine = FakeEngine(tokens)
    ran: list[int] = []
    ahead: list[int] = []
    queued: list[int] = []
    with OrderedFeeder(jobs(n, ran), engine.add, backlog=engine.backlog, step_tokens=STEP_TOKENS) as feeder:
        assert feeder.num_started == WINDOW_FLOOR  # not all 300 at once
        drain(feeder, engine, ahead, queued)
    assert engine.started == list(range(n))
    assert sorted(ran) == list(range(n))
    window = max(WINDOW_FLOOR, math.ceil(AHEAD_STEPS * STEP_TOKENS / tokens))
    # Started-but-not-added jobs plus the engine's queue stay within the window...
    assert max(ahead) <= window
    # ...and from the second feed on (the first learns the prompts' length) every step is offered a full budget.
    taken = queued[0]
    for i, q in enumerate(queued[1:], start=1):
        assert q >= min(engine.per_step, n - taken), (i, queued[:12])
        taken += min(q, engine.per_step)


def test_without_a_backlog_every_job_starts_at_once() -> None:
    engine = FakeEngine(1000)
    with OrderedFeeder(jobs(50), engine.add) as feeder:
        assert feeder.num_started == 50
        drain(feeder, engine, [], [])
    assert engine.started == list(range(50))


def test_a_backlog_needs_the_step_budget() -> None:
    with pytest.raises(ValueError, match="go together"):
        OrderedFeeder(jobs(3), lambda k, r: None, backlog=lambda: (0, 0))


def test_all_at_once_adds_every_prompt_in_the_first_feed_even_with_a_backlog() -> None:
    engine = FakeEngine(1000)
    with OrderedFeeder(jobs(30), engine.add, all_at_once=True, backlog=engine.backlog,
                       step_tokens=STEP_TOKENS) as feeder:
        assert feeder.num_started == 30
        feeder.feed(block=False)
        assert feeder.done and engine.queue == list(range(30))


def test_a_failing_job_reaches_the_caller_through_its_result_and_the_others_still_arrive() -> None:
    def bad() -> int:
        raise ValueError("bad picture")

    work = jobs(40)
    work[5] = bad
    got, errors = [], []

    def add(k: int, result) -> None:
        try:
            got.append(result())
        except ValueError as e:
            errors.append((k, str(e)))

    with OrderedFeeder(work, add, backlog=lambda: (0, 0), step_tokens=STEP_TOKENS) as feeder:
        while not feeder.done:
            feeder.feed(block=True)
    assert errors == [(5, "bad picture")]
    assert got == [k * k for k in range(40) if k != 5]


def test_a_single_job_runs_inline() -> None:
    engine = FakeEngine(1000)
    with OrderedFeeder(jobs(1), engine.add, backlog=engine.backlog, step_tokens=STEP_TOKENS) as feeder:
        feeder.feed(block=True)
        assert feeder.done and engine.queue == [0]
