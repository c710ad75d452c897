"""SLA tiers (YAML, validation, resolve), the adaptive token budget, and admission control."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flashvlm.server.admission import Admission, QueueFullError
from flashvlm.server.budget import AdaptiveBudgetController, BudgetSteering
from flashvlm.server.tiers import SLAConfigError, TierConfig, load_tiers, parse_tiers

# ---------------------------------------------------------------- tiers


def test_packaged_default_tiers() -> None:
    cfg = load_tiers(None)
    assert cfg.names == ["gold", "silver", "bronze"]
    gold = cfg.resolve("gold")
    assert (gold.priority, gold.ttft_p99_ms, gold.tpot_p99_ms) == (0, 500, 50)
    assert gold.tpot_s == pytest.approx(0.05) and gold.ttft_s == pytest.approx(0.5)
    assert cfg.resolve("bronze").share == 0.5
    assert cfg.resolve(None).name == cfg.default == "silver"
    assert cfg.resolve(" GOLD ").name == "gold"  # header values arrive in any case


def test_resolve_unknown_names_the_valid_tiers() -> None:
    cfg = load_tiers(None)
    with pytest.raises(ValueError, match="platinum.*gold, silver, bronze"):
        cfg.resolve("platinum")
    with pytest.raises(ValueError, match="valid tiers"):
        cfg.resolve(3)  # type: ignore[arg-type]


def test_load_from_file_sorts_by_priority_and_defaults_to_last(tmp_path: Path) -> None:
    path = tmp_path / "tiers.yaml"
    path.write_text("tiers:\n"
                    "  batch: {priority: 5, ttft_p99_ms: 60000, tpot_p99_ms: 500, max_batch: 8}\n"
                    "  live: {priority: 0, ttft_p99_ms: 300.5, tpot_p99_ms: 40}\n")
    cfg = load_tiers(path)
    assert cfg.names == ["live", "batch"]
    assert cfg.resolve("batch").max_batch == 8
    assert cfg.resolve("live").ttft_p99_ms == 300.5
    assert cfg.default == "batch"  # untagged traffic does not outrank tagged traffic
    assert cfg.tightest_tpot_s(["batch", "live"]) == pytest.approx(0.04)
    assert cfg.tightest_tpot_s([]) is None


@pytest.mark.parametrize("doc, match", [
    ("[1, 2]", "expected a mapping"),
    ("tiers: {}", "non-empty mapping"),
    ("tierz: {a: {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: 1}}", "unknown top-level"),
    ("tiers: {a: {priority: 0, ttft_p99_ms: 1}}", "tier 'a': missing required field 'tpot_p99_ms'"),
    ("tiers: {a: {priority: 0.5, ttft_p99_ms: 1, tpot_p99_ms: 1}}", "priority must be an integer"),
    ("tiers: {a: {priority: 0, ttft_p99_ms: -5, tpot_p99_ms: 1}}", "ttft_p99_ms must be a positive number"),
    ("tiers: {a: {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: fast}}", "tpot_p99_ms must be a positive number"),
    ("tiers: {a: {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: 1, share: 1.5}}", r"share must be in \(0, 1\]"),
    ("tiers: {a: {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: 1, max_batch: 0}}", "max_batch must be a positive"),
    ("tiers: {a: {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: 1, ttft_ms: 3}}", r"unknown field\(s\) \['ttft_ms'\]"),
    ("tiers: {a: {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: 1}, A: {priority: 1, ttft_p99_ms: 1, tpot_p99_ms: 1}}",
     "unique"),
    ("default_tier: gold\ntiers: {a: {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: 1}}", "default_tier 'gold'"),
    ("tiers: {'a b': {priority: 0, ttft_p99_ms: 1, tpot_p99_ms: 1}}", "tier name 'a b'"),
    ("tiers: {a: 3}", "expected a mapping of fields"),
])
def test_invalid_tier_files_raise_clear_errors(tmp_path: Path, doc: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(doc)
    with pytest.raises(SLAConfigError, match=match) as info:
        load_tiers(path)
    assert str(path) in str(info.value)


def test_unreadable_and_malformed_yaml(tmp_path: Path) -> None:
    with pytest.raises(SLAConfigError, match="cannot read SLA tier file"):
        load_tiers(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: {gold: [unclosed")
    with pytest.raises(SLAConfigError, match="invalid YAML"):
        load_tiers(bad)


# ---------------------------------------------------------------- adaptive budget

TIERS = parse_tiers({"tiers": {"gold": {"priority": 0, "ttft_p99_ms": 500, "tpot_p99_ms": 50},
                               "bronze": {"priority": 2, "ttft_p99_ms": 10000, "tpot_p99_ms": 250}}})


def _ctl(initial: int = 4096, **kw: int) -> AdaptiveBudgetController:
    kw.setdefault("min_samples", 8)
    kw.setdefault("cooldown_steps", 8)
    return AdaptiveBudgetController(initial, 256, 8192, TIERS, window=32, grow_step=256, **kw)


def _feed(ctl: AdaptiveBudgetController, latency: float, steps: int, tiers: tuple[str, ...] = ("gold",),
          decode: int = 16) -> list[int]:
    return [ctl.update(latency, decode, tiers) for _ in range(steps)]


def test_halves_on_sustained_overload_and_stops_at_min() -> None:
    ctl = _ctl()
    budgets = _feed(ctl, 0.1, 8)  # 100 ms steps vs gold's 50 ms TPOT: 2x > 1.5x
    assert budgets[:7] == [4096] * 7 and budgets[7] == 2048  # decides once min_samples are in
    _feed(ctl, 0.1, 200)
    assert ctl.budget == 16 + 512  # the 16 decoding sequences plus the prefill allowance
    no_allowance = _ctl(min_prefill_tokens=0)
    _feed(no_allowance, 0.1, 200)
    assert no_allowance.budget == 256  # clamped at min_budget
    assert ctl.last_p99_s == pytest.approx(0.1)
    assert ctl.last_target_s == pytest.approx(0.05)


def test_grows_when_fast_and_stops_at_max() -> None:
    ctl = _ctl(initial=1024)
    budgets = _feed(ctl, 0.02, 8)  # 20 ms < 0.7 x 50 ms
    assert budgets[-1] == 1280
    _feed(ctl, 0.02, 1000)
    assert ctl.budget == 8192


def test_holds_inside_the_band() -> None:
    ctl = _ctl()
    assert set(_feed(ctl, 0.05, 100)) == {4096}  # exactly on target
    assert set(_feed(ctl, 0.072, 100)) == {4096}  # 1.44x: still inside (0.7x, 1.5x)


def test_tightest_active_tier_sets_the_target() -> None:
    ctl = _ctl()
    _feed(ctl, 0.1, 50, tiers=("bronze",))  # 100 ms is 0.4x bronze's 250 ms: a grow every 8 steps
    grown = ctl.budget
    assert grown == 4096 + 6 * 256
    _feed(ctl, 0.1, 8, tiers=("bronze", "gold"))  # gold joins: 100 ms is now 2x its target
    assert ctl.budget == grown // 2


def test_cooldown_and_window_restart_after_a_change() -> None:
    ctl = _ctl(min_samples=4, cooldown_steps=12)
    budgets = _feed(ctl, 0.1, 40)
    change_steps = [i for i in range(1, len(budgets)) if budgets[i] != budgets[i - 1]]
    assert change_steps, budgets
    assert all(b - a >= 12 for a, b in zip(change_steps, change_steps[1:])), change_steps
    # Overload samples from before a shrink must not trigger the next decision: after halving, fast steps grow it.
    ctl = _ctl(min_samples=4, cooldown_steps=4)
    _feed(ctl, 0.1, 4)
    assert ctl.budget == 2048
    _feed(ctl, 0.01, 4)
    assert ctl.budget == 2048 + 256


def test_steps_without_decode_or_tiers_are_ignored() -> None:
    ctl = _ctl()
    _feed(ctl, 5.0, 50, decode=0)  # pure prefill: nobody waits on a token
    _feed(ctl, 5.0, 50, tiers=())
    assert ctl.budget == 4096


def test_budget_never_starves_running_decodes() -> None:
    ctl = AdaptiveBudgetController(300, 256, 8192, TIERS, min_samples=2, cooldown_steps=0)
    _feed(ctl, 1.0, 10, decode=400)  # overloaded, but 400 sequences each need a token per step
    assert ctl.budget == 400 + 512  # and admission keeps a prefill allowance, so no queue grows without bound
    _feed(ctl, 1.0, 10, decode=8000)
    assert ctl.budget == 8192  # never past max_budget


def test_invalid_controller_arguments() -> None:
    with pytest.raises(ValueError):
        AdaptiveBudgetController(100, 200, 100, TIERS)
    with pytest.raises(ValueError):
        AdaptiveBudgetController(100, 1, 1000, TIERS, grow_below=2.0, shrink_above=1.5)
    with pytest.raises(ValueError):
        _ctl().update(0.1, 1, ["platinum"])
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        _ctl(min_prefill_tokens=-1)
    assert isinstance(AdaptiveBudgetController(100, 1, 1000).tiers, TierConfig)  # packaged default


# ---------------------------------------------------------------- admission


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_admission_admits_below_the_bound() -> None:
    adm = Admission(max_waiting=10)
    assert adm.retry_after(0) is None and adm.retry_after(9) is None
    assert adm.retry_after(10) == 30  # nothing finished yet: the longest wait


def test_retry_after_follows_recent_throughput() -> None:
    clock = FakeClock()
    adm = Admission(max_waiting=10, clock=clock)
    for _ in range(20):  # 4 requests/s for 5 s
        clock.t += 0.25
        adm.record_finished()
    assert adm.throughput() == pytest.approx(20 / 4.75)
    assert adm.retry_after(10) == 3  # 10 waiting at ~4.2/s -> 2.4 s -> 3
    assert adm.retry_after(1000) == 30  # clamped above
    adm.record_finished(1000)
    assert adm.retry_after(10) == 1  # clamped below
    clock.t += 31.0  # all completions aged out of the window: the engine looks stalled
    assert adm.throughput() is None and adm.retry_after(10) == 30


def test_num_ahead_lets_high_tiers_past_a_queue_of_low_tiers() -> None:
    adm = Admission(max_waiting=10)
    assert adm.retry_after(15, num_ahead=2) is None  # gold behind 2 gold, 13 bronze waiting
    assert adm.retry_after(15, num_ahead=10) is not None
    assert adm.retry_after(20, num_ahead=0) is not None  # the hard bound (2x) still caps memory
    with pytest.raises(ValueError):
        Admission(0)


def test_one_admission_object_counts_every_stage_and_refuses_with_its_retry_after() -> None:
    clock = FakeClock()
    adm = Admission(max_waiting=3, clock=clock)
    preparing = adm.reserve(priority=1)
    pending = adm.reserve(priority=1)
    pending.submit()  # handed to the engine thread
    adm.update_engine({1: 1}, applied=[])  # one more already waits in the scheduler
    assert adm.stats()["num_queued"] == 3
    for _ in range(8):  # 2 requests/s
        clock.t += 0.5
        adm.record_finished()
    with pytest.raises(QueueFullError) as refused:
        adm.reserve(priority=1)
    assert refused.value.retry_after_s == adm.retry_after(3) == 2  # 3 ahead at 2/s: the same formula
    assert refused.value.limit == 3 and adm.stats()["num_rejected"] == 1
    adm.reserve(priority=0).release()  # nothing of priority 0 or better waits: admitted
    adm.update_engine({1: 2}, applied=[1])  # the engine thread added the pending one
    preparing.release()
    preparing.release()  # idempotent
    with pytest.raises(RuntimeError):
        pending.submit()  # already used
    assert adm.stats()["num_queued"] == 2 and adm.stats()["peak_num_queued"] == 4


class _FakeEngine:
    """The part of Engine that BudgetSteering uses."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=max_num_seqs,
                                                                max_num_batched_tokens=max_num_batched_tokens))
        self.step_log: Any = None
        self.budgets: list[int] = []

    def running_groups(self) -> set[str]:
        return {"gold"}

    def set_token_budget(self, n: int) -> int:
        self.budgets.append(n)
        return n


class _Answer:
    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.calls: list[tuple[float, int, set[str]]] = []

    def update(self, step_latency_s: float, num_decode_seqs: int, active_tiers: Any) -> int:
        self.calls.append((step_latency_s, num_decode_seqs, set(active_tiers)))
        if self.budget is None:
            raise RuntimeError("controller bug")
        return self.budget


def test_budget_steering_feeds_the_controller_and_sets_the_engine_budget() -> None:
    engine = _FakeEngine(max_num_seqs=16, max_num_batched_tokens=1024)
    answer = _Answer(budget=4)
    steering = BudgetSteering(engine, answer)  # type: ignore[arg-type]
    engine.step_log.append(SimpleNamespace(num_decode_tokens=5))
    steering.after_step(0.02)
    assert answer.calls == [(0.02, 5, {"gold"})]
    assert engine.budgets == [16]  # never below a full batch of decodes
    answer.budget = 300
    steering.after_step(0.02)
    assert engine.budgets[-1] == 300
    answer.budget = None  # the controller fails: switched off, the configured budget restored
    steering.after_step(0.02)
    assert engine.budgets[-1] == 1024 and steering.controller is None
    steering.after_step(0.02)
    assert len(answer.calls) == 3 and len(engine.budgets) == 3
