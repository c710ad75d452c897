"""Per-group running caps (the SLA tiers' share and max_batch) in the scheduler, and the caps the tiers give."""

from __future__ import annotations

import pytest

from flashvlm.cache.block_manager import BlockManager
from flashvlm.cache.encoder_cache import EncoderCacheManager
from flashvlm.config import ConfigError, EngineConfig, ModelConfig, SchedulerConfig
from flashvlm.engine.scheduler import Scheduler
from flashvlm.request import Request, SamplingParams
from flashvlm.server.tiers import parse_tiers


def make(caps: dict[str, int], max_num_seqs: int = 6, shares: dict[str, int] | None = None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                                     max_running_per_group=caps, share_running_per_group=shares or {}),
                     BlockManager(256, 4), EncoderCacheManager(0), max_model_len=0, lookahead_slots=0)


def req(rid: str, group: str | None, priority: int = 0, arrival: float = 0.0, max_tokens: int = 3) -> Request:
    return Request(rid, [11, 12, 13, 14, 15], SamplingParams(max_tokens=max_tokens), priority=priority,
                   arrival_time=arrival, group=group)


def finish_step(sched: Scheduler) -> list[str]:
    out = sched.schedule()
    sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    return [s.request.request_id for s in out.scheduled]


def test_a_full_group_waits_while_other_groups_behind_it_are_admitted() -> None:
    sched = make({"bronze": 2})
    # Bronze arrived first (same priority): FCFS alone would fill the batch with it.
    for i in range(5):
        sched.add_request(req(f"b{i}", "bronze", arrival=i))
    for i in range(3):
        sched.add_request(req(f"g{i}", "gold", arrival=10 + i))
    sched.add_request(req("u", None, arrival=20))
    first = finish_step(sched)
    assert first == ["b0", "b1", "g0", "g1", "g2", "u"]
    running = [r for r in sched.requests.values() if r.status.name == "RUNNING"]
    assert sum(r.group == "bronze" for r in running) == 2
    # As bronze requests finish, the next bronze ones take their places, never more than two at once.
    seen_max = 0
    while sched.has_unfinished():
        finish_step(sched)
        running = [r for r in sched.requests.values() if r.status.name == "RUNNING"]
        seen_max = max(seen_max, sum(r.group == "bronze" for r in running))
    assert seen_max <= 2
    assert sched.num_waiting == 0


def test_no_caps_is_plain_fcfs() -> None:
    sched = make({})
    for i in range(4):
        sched.add_request(req(f"b{i}", "bronze", arrival=i))
    assert finish_step(sched) == ["b0", "b1", "b2", "b3"]


def test_tier_caps_from_share_and_max_batch() -> None:
    tiers = parse_tiers({"tiers": {
        "gold": {"priority": 0, "ttft_p99_ms": 100, "tpot_p99_ms": 20},
        "silver": {"priority": 1, "ttft_p99_ms": 500, "tpot_p99_ms": 50, "max_batch": 8},
        "bronze": {"priority": 2, "ttft_p99_ms": 5000, "tpot_p99_ms": 200, "share": 0.25, "max_batch": 20},
        "tiny": {"priority": 3, "ttft_p99_ms": 5000, "tpot_p99_ms": 200, "share": 0.001}}})
    assert tiers.running_caps() == {"silver": 8, "bronze": 20}
    assert tiers.running_shares(64) == {"bronze": 16, "tiny": 1}
    assert tiers.running_shares(200) == {"bronze": 20, "tiny": 1}  # never past max_batch


def running(sched: Scheduler, group: str) -> list[str]:
    return sorted(r.request_id for r in sched.requests.values() if r.status.name == "RUNNING" and r.group == group)


def test_a_share_lends_idle_slots() -> None:
    """Past its share a group still fills slots nobody else wants, after the requests queued behind it."""
    sched = make({}, shares={"bronze": 2})
    for i in range(5):
        sched.add_request(req(f"b{i}", "bronze", priority=2, arrival=i))
    sched.add_request(req("s", "silver", priority=1, arrival=9))
    assert finish_step(sched) == ["s", "b0", "b1", "b2", "b3", "b4"]


def test_a_borrowed_slot_is_taken_back_for_a_better_tier() -> None:
    sched = make({}, shares={"bronze": 2}, max_num_seqs=4)
    for i in range(5):
        sched.add_request(req(f"b{i}", "bronze", priority=2, arrival=i, max_tokens=20))
    assert finish_step(sched) == ["b0", "b1", "b2", "b3"]  # two of them borrowed
    sched.add_request(req("g", "gold", priority=0, arrival=10, max_tokens=20))
    step = finish_step(sched)
    assert "g" in step and running(sched, "bronze") == ["b0", "b1", "b2"]  # the newest borrower gave way
    assert sched.requests["b3"].num_preemptions == 1
    sched.add_request(req("g2", "gold", priority=0, arrival=11, max_tokens=20))
    assert "g2" in finish_step(sched) and running(sched, "bronze") == ["b0", "b1"]
    sched.add_request(req("g3", "gold", priority=0, arrival=12, max_tokens=20))
    finish_step(sched)  # bronze is within its share now: gold waits for a slot instead of preempting it
    assert running(sched, "bronze") == ["b0", "b1"] and sched.requests["g3"].status.name == "WAITING"
    while sched.has_unfinished():
        finish_step(sched)


def test_hard_cap_holds_when_borrowing() -> None:
    sched = make({"bronze": 3}, shares={"bronze": 1})
    for i in range(5):
        sched.add_request(req(f"b{i}", "bronze", priority=2, arrival=i))
    assert finish_step(sched) == ["b0", "b1", "b2"]


@pytest.mark.parametrize("field,value", [("max_running_per_group", {"bronze": 0}),
                                         ("share_running_per_group", {"bronze": -1}),
                                         ("shared_prefix_wait_tokens", -16),
                                         ("shared_prefix_wait_tokens", 1.5),
                                         ("shared_prefix_wait_tokens", None)])
def test_caps_are_validated(field: str, value) -> None:
    cfg = EngineConfig(model=ModelConfig(model="x"), device="cpu", scheduler=SchedulerConfig(**{field: value}))
    with pytest.raises(ConfigError, match=field):
        cfg.validate()


@pytest.mark.parametrize("field", ["vision_graphs", "prefill_graph_max_tokens"])
def test_graph_settings_are_validated(field: str) -> None:
    cfg = EngineConfig(model=ModelConfig(model="x"), device="cpu", **{field: -1})
    with pytest.raises(ConfigError, match=field):
        cfg.validate()


def test_waiting_higher_priority_is_served_before_a_running_lower_priority_prefill() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), BlockManager(256, 4),
                      EncoderCacheManager(0), max_model_len=0, lookahead_slots=0)
    bronze = Request("bronze", list(range(10, 40)), SamplingParams(max_tokens=2), priority=2, arrival_time=0.0)
    sched.add_request(bronze)
    first = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("bronze", 8)]
    sched.update(first, {})
    gold = Request("gold", [11, 12, 13, 14, 15], SamplingParams(max_tokens=2), priority=0, arrival_time=1.0)
    sched.add_request(gold)
    second = sched.schedule()
    # Gold's whole prompt goes first; bronze's next chunk takes only what is left of the 8-token budget.
    assert [(s.request.request_id, s.num_new_tokens) for s in second.scheduled] == [("gold", 5), ("bronze", 3)]
    sched.update(second, {"gold": 7})
    third = sched.schedule()  # nothing waits: bronze's chunk and gold's decode token, in priority order
    assert [(s.request.request_id, s.num_new_tokens) for s in third.scheduled] == [("gold", 1), ("bronze", 7)]


def test_a_borrowed_slot_is_not_taken_back_for_a_request_that_then_waits() -> None:
    """A better request that will wait for shared blocks in flight leaves the borrowed slot alone: preempting its
    holder would buy nothing this step."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=24, share_running_per_group={"bronze": 1},
                                      shared_prefix_wait_tokens=8),
                      BlockManager(256, 4, enable_prefix_caching=True), EncoderCacheManager(0), max_model_len=0,
                      lookahead_slots=0)
    for i, prompt in enumerate(([1, 2, 3, 4, 5], [1, 2, 3, 9, 5])):
        sched.add_request(Request(f"b{i}", prompt, SamplingParams(max_tokens=50), priority=2, arrival_time=i,
                                  group="bronze"))
    finish_step(sched)  # b1 borrows a slot past bronze's share of 1
    shared = list(range(100, 164))
    sched.add_request(Request("g0", shared, SamplingParams(max_tokens=50), priority=0, arrival_time=3, group="gold"))
    finish_step(sched)  # g0 takes the free slot and starts its 64-token prompt
    g1 = Request("g1", shared + [7], SamplingParams(max_tokens=5), priority=0, arrival_time=4, group="gold")
    sched.add_request(g1)
    assert "g1" not in finish_step(sched)  # it waits for g0's blocks...
    assert sched.num_preemptions_total == 0  # ...so b1 keeps its slot for now
    while sched.has_unfinished():
        finish_step(sched)
    assert len(g1.output_token_ids) == 5 and g1.num_cached_tokens > 0


def test_borrowed_slot_is_not_taken_back_when_the_better_request_still_cannot_start() -> None:
    """Batch full, and even preempting every bronze request would not free the blocks gold's new prompt needs:
    the borrower keeps its slot and its progress (no preemption for nothing)."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256,
                                      share_running_per_group={"bronze": 1}),
                      BlockManager(13, 4, False), EncoderCacheManager(0), max_model_len=0,
                      lookahead_slots=0)  # 12 usable blocks of 4
    sched.add_request(Request("gA", list(range(28)), SamplingParams(max_tokens=50), group="gold", arrival_time=0))
    for i in range(2):  # the second one borrows a slot past bronze's share
        sched.add_request(Request(f"b{i}", [1, 2, 3], SamplingParams(max_tokens=50), priority=2, group="bronze",
                                  arrival_time=1 + i))
    for _ in range(2):
        finish_step(sched)
    sched.add_request(Request("g0", list(range(100, 124)), SamplingParams(max_tokens=5), group="gold",
                              arrival_time=3))
    for _ in range(3):
        assert finish_step(sched) == ["gA", "b0", "b1"]
    assert sched.num_preemptions_total == 0 and sched.num_waiting == 1


def test_requests_held_only_by_a_hard_cap_do_not_count_as_admittable() -> None:
    """may_admit tells the runner whether a waiting request could join next step (if not, it launches decode
    steps ahead). A backlog its group's hard cap holds back cannot, however much room the batch has."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_running_per_group={"bronze": 2}),
                      BlockManager(256, 4), EncoderCacheManager(0), max_model_len=0, lookahead_slots=1)
    for i in range(6):
        sched.add_request(req(f"b{i}", "bronze", arrival=i, max_tokens=50))
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
        assert [s.request.request_id for s in out.scheduled] == ["b0", "b1"] and not out.may_admit
    # Another group's request is seated at once; what waits after it is still only the capped backlog.
    sched.add_request(req("g", "gold", arrival=10))
    out = sched.schedule()
    assert "g" in [s.request.request_id for s in out.scheduled] and not out.may_admit
    # Uncapped requests left waiting by the token budget, with seats free, do count.
    tight = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=5, max_running_per_group={"bronze": 2}),
                      BlockManager(256, 4), EncoderCacheManager(0), max_model_len=0, lookahead_slots=0)
    for i in range(3):
        tight.add_request(req(f"g{i}", "gold", arrival=i))
    out = tight.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["g0"] and out.may_admit
