"""The image pool's fairness: one request's jobs never run more than its share at once, the sessions' jobs are
served round-robin, and closing a session cancels what it had waiting. Jobs block on Events; every wait is
bounded and nothing asserts how long anything took."""

from __future__ import annotations

import threading

import pytest

from flashvlm.processing.image_pool import ImagePool, default_image_threads, default_share

WAIT_S = 30


class _Gate:
    """Jobs that report when they start and run until released."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started: list[str] = []
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def job(self, name: str):
        def run() -> str:
            with self.lock:
                self.started.append(name)
            self.entered.release()
            assert self.release.wait(WAIT_S), "never released"
            return name
        return run

    def wait_started(self, n: int) -> None:
        for _ in range(n):
            assert self.entered.acquire(timeout=WAIT_S), f"only {self.started} started"


def test_a_request_cannot_take_more_than_its_share() -> None:
    pool = ImagePool(threads=4, per_request=2)
    gate = _Gate()
    try:
        many = pool.session()
        futures = [many.submit(gate.job(f"a{i}")) for i in range(12)]
        gate.wait_started(2)
        other = pool.session()
        late = other.submit(gate.job("b0"))
        gate.wait_started(1)  # a free worker takes the other request's image while a's ten wait
        assert sorted(gate.started) == ["a0", "a1", "b0"]
        assert many.running == 2 and pool.stats()["image_jobs_waiting"] == 10
        gate.release.set()
        assert [f.result(WAIT_S) for f in futures] == [f"a{i}" for i in range(12)]
        assert late.result(WAIT_S) == "b0"
    finally:
        gate.release.set()
        pool.shutdown()


def test_sessions_take_turns() -> None:
    pool = ImagePool(threads=1, per_request=1)
    gate = _Gate()
    order: list[str] = []
    try:
        first, second = pool.session(), pool.session()
        blocker = first.submit(gate.job("block"))
        gate.wait_started(1)
        jobs = [first.submit(lambda i=i: order.append(f"a{i}")) for i in range(3)]
        jobs += [second.submit(lambda i=i: order.append(f"b{i}")) for i in range(2)]
        gate.release.set()
        for f in [blocker, *jobs]:
            f.result(WAIT_S)
        assert order == ["a0", "b0", "a1", "b1", "a2"]
    finally:
        gate.release.set()
        pool.shutdown()


def test_closing_a_session_cancels_its_waiting_jobs() -> None:
    pool = ImagePool(threads=1, per_request=1)
    gate = _Gate()
    try:
        session = pool.session()
        running = session.submit(gate.job("running"))
        gate.wait_started(1)
        waiting = [session.submit(gate.job(f"w{i}")) for i in range(3)]
        session.close()
        assert all(f.cancelled() for f in waiting)
        gate.release.set()
        assert running.result(WAIT_S) == "running"  # a started job finishes
        assert pool.session().submit(lambda: "next").result(WAIT_S) == "next"
        assert gate.started == ["running"]
    finally:
        gate.release.set()
        pool.shutdown()


def test_errors_reach_the_caller_and_the_worker_goes_on() -> None:
    pool = ImagePool(threads=1, per_request=1)
    try:
        session = pool.session()
        bad = session.submit(lambda: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            bad.result(WAIT_S)
        assert session.submit(lambda: 7).result(WAIT_S) == 7
    finally:
        pool.shutdown()


def test_sizes_come_from_the_machine_and_are_checked() -> None:
    assert 1 <= default_image_threads() <= 32
    assert [default_share(n) for n in (1, 2, 3, 8)] == [1, 1, 1, 4]
    with pytest.raises(ValueError, match="threads"):
        ImagePool(threads=0)
    with pytest.raises(ValueError, match="decodes-per-request"):
        ImagePool(threads=1, per_request=0)
