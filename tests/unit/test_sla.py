"""SLA tiers (YAML, validation, resolve), the adaptive token budget, and admission control."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashvlm.engine.sla import (
    AdaptiveBudgetController,
    AdmissionController,
    SLAConfigError,
    TierConfig,
    load_tiers,
    parse_tiers,
)

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
    adm = AdmissionController(max_waiting=10)
    assert adm.check(0) is None and adm.check(9) is None
    assert adm.check(10) == 30  # nothing finished yet: the longest wait


def test_retry_after_follows_recent_throughput() -> None:
    clock = FakeClock()
    adm = AdmissionController(max_waiting=10, clock=clock)
    for _ in range(20):  # 4 requests/s for 5 s
        clock.t += 0.25
        adm.record_finished()
    assert adm.throughput() == pytest.approx(20 / 4.75)
    assert adm.check(10) == 3  # 10 waiting at ~4.2/s -> 2.4 s -> 3
    assert adm.check(1000) == 30  # clamped above
    adm.record_finished(1000)
    assert adm.check(10) == 1  # clamped below
    clock.t += 31.0  # all completions aged out of the window: the engine looks stalled
    assert adm.throughput() is None and adm.check(10) == 30


def test_num_ahead_lets_high_tiers_past_a_queue_of_low_tiers() -> None:
    adm = AdmissionController(max_waiting=10)
    assert adm.check(15, num_ahead=2) is None  # gold behind 2 gold, 13 bronze waiting
    assert adm.check(15, num_ahead=10) is not None
    assert adm.check(20, num_ahead=0) is not None  # the hard bound (2x) still caps memory
    with pytest.raises(ValueError):
        AdmissionController(0)
