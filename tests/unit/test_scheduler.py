"""Scheduler with a fake runner: no torch, no model.

The fake runner keeps a paged "KV cache" of token ids (image placeholders stand for their picture
and index in it, so two images behind the same ids differ). Every step it writes the scheduled
tokens through the block table and, before sampling, reads the whole context back through it,
so a write into a shared or cached block, a stale block after preemption or a wrong table fails
the test. Sampled tokens are a function of the context read back, so the expected output of
every request can be computed independently of scheduling (and of prefix caching).
"""

from __future__ import annotations

import random
import sys
import zlib
from collections.abc import Callable

import pytest

from flashvlm.cache.block_manager import BlockManager
from flashvlm.cache.encoder_cache import EncoderCacheManager
from flashvlm.config import SchedulerConfig
from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.engine.scheduler import KV_CAPACITY_STOP_REASON, Scheduler
from flashvlm.request import MMItem, Request, RequestStatus, SamplingParams

S = RequestStatus


def next_token(context: list[int]) -> int:
    return 100 + sum((i + 1) * t for i, t in enumerate(context)) % 900


def kv_values(tokens: list[int], mm: list[MMItem] | None = None) -> list[int]:
    """What the fake KV cache holds per position: the token id, or for an image placeholder a value
    naming the picture and the index in it (what its embedding would carry)."""
    values = list(tokens)
    for it in mm or ():
        for k in range(it.num_tokens):
            values[it.offset + k] = 1000 + zlib.crc32(f"{it.mm_hash}:{k}".encode()) % 100_000
    return values


def expected_output(prompt: list[int], max_tokens: int, mm: list[MMItem] | None = None) -> list[int]:
    seq = kv_values(prompt, mm)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def make_sched(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
               budget: int = 32, max_model_len: int = 0, prefix_caching: bool = False,
               encoder_cache_tokens: int = 0, shared_prefix_wait_tokens: int = 0) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     shared_prefix_wait_tokens=shared_prefix_wait_tokens),
                     BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching),
                     EncoderCacheManager(encoder_cache_tokens), max_model_len=max_model_len, lookahead_slots=0)


def make_req(rid: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, arrival: float = 0.0,
             mm: list[MMItem] | None = None, eos: tuple[int, ...] = (), **sp: object) -> Request:
    prompt = [10 + (7 * i + len(rid)) % 80 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), mm_items=mm or [],
                   priority=priority, arrival_time=arrival, eos_token_ids=eos)


def add(sched: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        sched.add_request(r)


def ids(out: SchedulerOutput) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def splits(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def image(mm_hash: str, offset: int, num_tokens: int) -> MMItem:
    return MMItem(mm_hash=mm_hash, pixel_values=None, offset=offset, num_tokens=num_tokens)


class FakeRunner:
    def __init__(self, sched: Scheduler, script: dict[str, list[int]] | None = None) -> None:
        self.sched = sched
        self.bs = sched.block_manager.block_size
        self.kv: dict[int, int] = {}
        self.embeddings: set[str] = set()
        self.encoded: list[str] = []
        self.script = script  # request -> tokens to emit, instead of next_token

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        cfg = self.sched.config
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and self.sched.num_running <= cfg.max_num_seqs
        for h in out.free_encoder_hashes:
            self.embeddings.remove(h)  # KeyError = told to free something never encoded
        for rid, idxs in out.encoder_inputs.items():
            for i in idxs:
                h = self.sched.requests[rid].mm_items[i].mm_hash
                assert h not in self.embeddings, f"{h} encoded while already held"
                self.embeddings.add(h)
                self.encoded.append(h)
        sampled: dict[str, int] = {}
        all_blocks: list[int] = []
        bm = self.sched.block_manager
        for sr in out.scheduled:
            req = sr.request
            tokens = kv_values(req.all_token_ids, req.mm_items)
            assert sr.num_new_tokens > 0 and sr.end <= req.num_tokens
            need = -(-sr.end // self.bs)  # a lookahead slot may hold the next token's block too
            assert len(sr.block_ids) - need in (0, self.sched.lookahead_slots) and 0 not in sr.block_ids
            all_blocks += sr.block_ids
            for item in req.mm_items:
                if item.offset < sr.end and item.end > sr.start:
                    assert item.mm_hash in self.embeddings, f"{item.mm_hash} missing for {req.request_id}"
            for pos in range(sr.start, sr.end):
                block = bm.blocks[sr.block_ids[pos // self.bs]]
                # ref_cnt 0: the request was aborted after schedule(); its output is dropped.
                assert block.block_hash is None and block.ref_cnt <= 1, (
                    f"{req.request_id}: writes into shared or cached block {block.block_id}")
                self.kv[self._slot(sr.block_ids, pos)] = tokens[pos]
            if sr.samples:
                context = [self.kv[self._slot(sr.block_ids, p)] for p in range(sr.end)]
                assert context == tokens[:sr.end], f"{req.request_id}: KV cache corrupted"
                if self.script is not None:
                    sampled[req.request_id] = self.script[req.request_id][len(req.output_token_ids)]
                else:
                    sampled[req.request_id] = next_token(context)
        shared = {b for b in all_blocks if all_blocks.count(b) > 1}
        assert all(bm.blocks[b].block_hash is not None for b in shared), "two requests share an uncached block"
        return sampled

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.bs] * self.bs + pos % self.bs


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    changed = sched.update(out, runner.execute(out))
    sched.block_manager.check_invariants()
    sched.encoder_cache.check_invariants()
    return out, changed


def drive(sched: Scheduler, runner: FakeRunner, max_steps: int = 5000,
          each_step: Callable[[int], None] | None = None) -> dict[str, Request]:
    finished: dict[str, Request] = {}
    for n in range(max_steps):
        if each_step is not None:
            each_step(n)
        if not sched.has_unfinished():
            break
        out, changed = step(sched, runner)
        assert not out.is_empty or not sched.has_unfinished(), "stalled: nothing scheduled"
        finished.update({r.request_id: r for r in changed if r.is_finished})
    else:
        raise AssertionError("did not finish")
    runner.execute(sched.schedule())  # deliver the last frees
    bm, enc = sched.block_manager, sched.encoder_cache
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in bm.blocks)
    # Unreferenced embeddings may stay cached within the budget; the runner holds exactly those.
    assert enc.num_referenced == 0 and enc.num_cached_tokens <= enc.cache_tokens
    assert runner.embeddings == enc.held_hashes()
    return finished


def test_no_torch_import() -> None:
    import subprocess
    code = "import sys, flashvlm.engine.scheduler; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefill_then_one_token_decode() -> None:
    sched = make_sched(budget=16)
    sched.add_request(make_req("a", 40, max_tokens=3))
    runner = FakeRunner(sched)
    trace = []
    while sched.has_unfinished():
        out = sched.schedule()
        # start/end/samples derive from num_computed_tokens, so read them before update().
        trace.append([(sr.num_new_tokens, sr.samples) for sr in out.scheduled])
        sampled = runner.execute(out)
        assert sorted(sampled) == (["a"] if trace[-1][0][1] else [])
        sched.update(out, sampled)
    assert trace == [[(16, False)], [(16, False)], [(8, True)], [(1, True)], [(1, True)]]
    assert sched.requests == {}


def test_budget_goes_to_running_first_then_waiting() -> None:
    sched = make_sched(budget=8)
    add(sched, make_req("a", 4, max_tokens=10, arrival=0), make_req("b", 4, max_tokens=10, arrival=1))
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert splits(out) == [("a", 4), ("b", 4)]
    sched.add_request(make_req("c", 20, max_tokens=2, arrival=2))
    seen = []
    for _ in range(4):
        out, _ = step(sched, runner)
        seen.append(splits(out))
    assert seen == [[("a", 1), ("b", 1), ("c", 6)], [("a", 1), ("b", 1), ("c", 6)],
                      [("a", 1), ("b", 1), ("c", 6)], [("a", 1), ("b", 1), ("c", 2)]]


def test_max_num_seqs_respected_and_outputs_match_reference() -> None:
    sched = make_sched(max_num_seqs=2, budget=7)
    reqs = [make_req(f"r{i}", 3 + 3 * i, max_tokens=2 + i, arrival=i) for i in range(5)]
    add(sched, *reqs)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)
    assert ids(out) == ["r0", "r1"] and sched.num_running == 2 and sched.num_waiting == 3
    assert sched.waiting_prompt_tokens == 9 + 12 + 15  # r2..r4, none computed yet
    finished = drive(sched, runner)  # the runner asserts max_num_seqs every step
    assert sched.waiting_prompt_tokens == 0
    for r in reqs:
        want = expected_output(r.prompt_token_ids, r.sampling_params.max_tokens)
        assert finished[r.request_id].output_token_ids == want
        assert r.status is S.FINISHED_LENGTH and r.finish_time and r.first_token_time


def test_preempts_latest_arrival_and_resumes() -> None:
    sched = make_sched(num_blocks=5, block_size=4, budget=64)  # 16 tokens of KV
    a, b = make_req("a", 7, max_tokens=10, arrival=0), make_req("b", 7, max_tokens=10, arrival=1)
    add(sched, a, b)
    runner = FakeRunner(sched)
    step(sched, runner)  # both prefill: 2 blocks each, cache full
    step(sched, runner)  # both decode token 8: still 2 blocks each
    out, _ = step(sched, runner)  # a needs a 3rd block: b (tail) is preempted
    assert ids(out) == ["a"]
    assert out.finished_request_ids == ["b"]
    assert b.status is S.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert len(b.output_token_ids) == 2  # kept for the recompute
    assert sched.num_waiting == 1 and sched.block_manager.get_block_ids("b") == []
    finished = drive(sched, runner)
    assert finished["a"].output_token_ids == expected_output(a.prompt_token_ids, 10)
    assert finished["b"].output_token_ids == expected_output(b.prompt_token_ids, 10)


def test_self_preemption_mid_image_releases_and_later_reencodes_it() -> None:
    sched = make_sched(num_blocks=5, block_size=4, budget=11)
    a = make_req("a", 7, max_tokens=10, arrival=0)
    b = make_req("b", 12, max_tokens=2, arrival=1, mm=[image("X", 2, 10)])
    add(sched, a, b)
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)  # a: 7 tokens, b: [0, 4) -> X encoded
    assert out.encoder_inputs == {"b": [0]}
    out, _ = step(sched, runner)  # b's next chunk needs 2 blocks, 1 free: b is the tail, evicts itself
    assert ids(out) == ["a"] and b.status is S.PREEMPTED
    assert out.finished_request_ids == ["b"] and out.free_encoder_hashes == ["X"]
    assert drive(sched, runner)["b"].output_token_ids == expected_output(b.prompt_token_ids, 2, b.mm_items)
    assert runner.encoded == ["X", "X"]  # b recomputes from 0, so X is encoded again


def test_preemption_under_few_blocks_loses_nothing() -> None:
    sched = make_sched(num_blocks=9, block_size=4, budget=12, max_num_seqs=4)
    reqs = [make_req(f"r{i}", 10, max_tokens=12, arrival=i) for i in range(6)]
    for r in reqs:
        assert sched.can_ever_fit(r)
        sched.add_request(r)
    finished = drive(sched, FakeRunner(sched))
    assert sum(r.num_preemptions for r in reqs) > 0
    for r in reqs:
        assert finished[r.request_id].output_token_ids == expected_output(r.prompt_token_ids, 12)


def test_abort_waiting_and_running_frees_blocks() -> None:
    sched = make_sched(num_blocks=9, block_size=4, budget=8, max_num_seqs=1)
    add(sched, make_req("run", 20, mm=[image("img", 6, 8)], arrival=0), make_req("wait", 5, arrival=1))
    runner = FakeRunner(sched)
    out, _ = step(sched, runner)  # "run" prefills its first chunk, holds the image
    assert out.encoder_inputs == {"run": [0]}
    assert sched.block_manager.num_free_blocks == 8 - 2
    waiting = sched.abort_request("wait")
    assert waiting is not None and waiting.status is S.FINISHED_ABORTED and sched.num_waiting == 0
    out = sched.schedule()  # "run" gets its next chunk, still over the image; aborted before update
    assert out.finished_request_ids == ["wait"] and out.free_encoder_hashes == []
    running = sched.abort_request("run")
    assert running is not None and running.status is S.FINISHED_ABORTED and running.finish_time
    assert sched.block_manager.num_free_blocks == 8 and sched.num_running == 0
    assert sched.update(out, runner.execute(out)) == []  # the aborted request is skipped
    assert running.num_computed_tokens == 8
    assert sched.abort_request("run") is None and sched.abort_request("nope") is None
    out = sched.schedule()
    assert out.finished_request_ids == ["run"]
    assert out.free_encoder_hashes == ["img"] and sched.encoder_cache.num_entries == 0
    assert not sched.has_unfinished()


def test_priority_order_lower_first_then_arrival() -> None:
    sched = make_sched(max_num_seqs=1, budget=100)
    for rid, prio, arr in [("low", 5, 0), ("hi_late", 0, 2), ("hi", 0, 1), ("mid", 1, 3)]:
        sched.add_request(make_req(rid, 4, max_tokens=2, priority=prio, arrival=arr))
    order: list[str] = []
    runner = FakeRunner(sched)
    while sched.has_unfinished():
        _, changed = step(sched, runner)
        order += [r.request_id for r in changed if r.is_finished]
    assert order == ["hi", "hi_late", "mid", "low"]


def _low_runner_then(arrival_priority: int) -> tuple[Scheduler, FakeRunner, SchedulerOutput, Request]:
    sched = make_sched(num_blocks=5, block_size=4, budget=64)
    low = make_req("low", 12, max_tokens=3, priority=1, arrival=0)
    sched.add_request(low)
    runner = FakeRunner(sched)
    step(sched, runner)  # low holds 3 of 4 blocks
    new = make_req("new", 8, max_tokens=2, priority=arrival_priority, arrival=1)
    sched.add_request(new)
    out, _ = step(sched, runner)
    return sched, runner, out, low


def test_high_priority_arrival_preempts_low_priority_runner() -> None:
    sched, runner, out, low = _low_runner_then(arrival_priority=0)
    assert splits(out) == [("new", 8)]
    assert low.status is S.PREEMPTED and out.finished_request_ids == ["low"]
    assert low.output_token_ids == [expected_output(low.prompt_token_ids, 1)[0]]
    drive(sched, runner)
    assert low.output_token_ids == expected_output(low.prompt_token_ids, 3)


def test_preempted_runner_gives_back_its_budget() -> None:
    sched = make_sched(num_blocks=5, block_size=4, budget=12)
    sched.add_request(make_req("low", 12, max_tokens=3, priority=1, arrival=0))
    runner = FakeRunner(sched)
    step(sched, runner)
    add(sched, make_req("new", 11, max_tokens=2, arrival=1), make_req("tiny", 1, max_tokens=2, arrival=2))
    out, _ = step(sched, runner)  # low's decode token returns to the budget when new evicts it
    assert splits(out) == [("new", 11), ("tiny", 1)]
    drive(sched, runner)


def test_no_preemption_when_it_would_not_make_enough_room() -> None:
    sched = make_sched(num_blocks=5, block_size=4, budget=64)
    add(sched, make_req("same", 7, max_tokens=9, priority=0, arrival=0),
        make_req("low", 3, max_tokens=9, priority=1, arrival=1))
    runner = FakeRunner(sched)
    step(sched, runner)  # same: 2 blocks, low: 1 block, 1 free
    sched.add_request(make_req("new", 12, max_tokens=2, priority=0, arrival=2))  # needs 3
    out, _ = step(sched, runner)
    assert ids(out) == ["same", "low"] and sched.requests["low"].num_preemptions == 0


def test_equal_priority_arrival_waits_instead_of_preempting() -> None:
    sched, runner, out, low = _low_runner_then(arrival_priority=1)
    new = sched.requests["new"]
    assert ids(out) == ["low"]
    assert new.status is S.WAITING and low.num_preemptions == 0
    drive(sched, runner)
    assert new.status is S.FINISHED_LENGTH and low.num_preemptions == 0


def test_fcfs_head_blocks_smaller_requests_behind_it() -> None:
    sched = make_sched(num_blocks=5, block_size=4, budget=64)
    sched.add_request(make_req("big_running", 12, max_tokens=2, arrival=0))
    runner = FakeRunner(sched)
    step(sched, runner)  # 3 of 4 blocks used
    add(sched, make_req("head", 8, max_tokens=1, arrival=1), make_req("small", 2, max_tokens=1, arrival=2))
    out, _ = step(sched, runner)
    assert ids(out) == ["big_running"]
    finished = drive(sched, runner)
    assert finished["head"].finish_time <= finished["small"].finish_time


@pytest.mark.parametrize(("kw", "script", "want_out", "want_status", "want_reason"), [
    ({"eos": (2,)}, [5, 6, 2, 7], [5, 6, 2], S.FINISHED_STOPPED, None),
    ({"eos": (2,), "ignore_eos": True, "max_tokens": 4}, [5, 2, 2, 7], [5, 2, 2, 7], S.FINISHED_LENGTH, None),
    ({"eos": (2,), "min_tokens": 3}, [2, 2, 2, 2, 9], [2, 2, 2, 2], S.FINISHED_STOPPED, None),
    ({"stop_token_ids": [7]}, [5, 6, 7, 8], [5, 6, 7], S.FINISHED_STOPPED, 7),
    ({"stop_token_ids": [7], "min_tokens": 2}, [7, 7, 7, 8], [7, 7, 7], S.FINISHED_STOPPED, 7),
    ({"max_tokens": 3}, [5, 6, 7, 8], [5, 6, 7], S.FINISHED_LENGTH, None),
    ({"max_tokens": 100, "mml": 10}, [5, 6, 7, 8], [5, 6], S.FINISHED_LENGTH, None),
])
def test_stop_conditions(kw: dict, script: list[int], want_out: list[int], want_status: RequestStatus,
                         want_reason: int | None) -> None:
    kw = dict(kw)
    sched = make_sched(max_model_len=kw.pop("mml", 0))
    kw.setdefault("max_tokens", 10)
    req = make_req("r", 8, **kw)
    sched.add_request(req)
    runner = FakeRunner(sched, script={"r": script})
    changed_counts = []
    while sched.has_unfinished():
        _, changed = step(sched, runner)
        changed_counts.append(len(changed))
    assert req.output_token_ids == want_out
    assert req.status is want_status and req.stop_reason == want_reason
    assert changed_counts == [1] * len(want_out)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_usable_blocks


def test_finish_request_for_stop_string() -> None:
    sched = make_sched()
    req = make_req("r", 6, max_tokens=10)
    sched.add_request(req)
    runner = FakeRunner(sched)
    step(sched, runner)
    assert sched.finish_request("r", S.FINISHED_STOPPED, stop_reason="###") is req
    assert req.status is S.FINISHED_STOPPED and req.stop_reason == "###" and not sched.has_unfinished()
    assert sched.schedule().finished_request_ids == ["r"]
    with pytest.raises(ValueError):
        sched.finish_request("x", S.RUNNING)
    sched.add_request(make_req("y", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("y", 3))


def test_can_ever_fit_boundary() -> None:
    sched = make_sched(num_blocks=5, block_size=4)  # 16 tokens of KV
    assert sched.can_ever_fit(make_req("a", 10, max_tokens=7))  # last token never needs KV
    assert not sched.can_ever_fit(make_req("b", 10, max_tokens=8))
    assert not sched.can_ever_fit(make_req("c", 17, max_tokens=1))
    capped = make_sched(num_blocks=5, block_size=4, max_model_len=12)
    assert capped.can_ever_fit(make_req("d", 10, max_tokens=50))
    sched.add_request(make_req("a", 10, max_tokens=7))
    assert drive(sched, FakeRunner(sched))["a"].status is S.FINISHED_LENGTH


def test_request_too_big_for_cache_is_aborted_not_deadlocked() -> None:
    sched = make_sched(num_blocks=5, block_size=4, budget=8)
    add(sched, make_req("huge", 30, arrival=0),
        make_req("grows", 10, max_tokens=12, arrival=1),  # passes 16 tokens mid-decode
        make_req("ok", 5, max_tokens=3, arrival=2))
    finished = drive(sched, FakeRunner(sched))
    huge = finished["huge"]
    assert huge.status is S.FINISHED_ABORTED and huge.stop_reason == KV_CAPACITY_STOP_REASON
    assert huge.output_token_ids == []
    assert finished["grows"].status is S.FINISHED_ABORTED and len(finished["grows"].output_token_ids) == 7
    assert finished["ok"].status is S.FINISHED_LENGTH


def test_encoder_inputs_once_per_image_across_chunks() -> None:
    sched = make_sched(budget=8)
    a = make_req("a", 24, max_tokens=2, mm=[image("X", 2, 8), image("Y", 12, 8)], arrival=0)
    sched.add_request(a)
    runner = FakeRunner(sched)
    seen = []
    for _ in range(4):
        out, _ = step(sched, runner)
        seen.append((out.encoder_inputs, out.free_encoder_hashes))
    assert seen == [({"a": [0]}, []), ({"a": [1]}, []), ({}, ["X"]), ({}, ["Y"])]
    assert runner.encoded == ["X", "Y"]


def test_shared_and_repeated_images_encoded_once() -> None:
    sched = make_sched(budget=10)
    add(sched, make_req("a", 20, max_tokens=2, mm=[image("X", 0, 6), image("X", 10, 6)], arrival=0),
        make_req("b", 12, max_tokens=2, mm=[image("X", 4, 6)], arrival=1))
    runner = FakeRunner(sched)
    # a passes both X placeholders (releasing X) the step before b first reaches X: b must revive
    # the still-held embedding, not encode it again.
    drive(sched, runner)
    assert runner.encoded == ["X"]


@pytest.mark.parametrize("caching", [False, True], ids=["no_cache", "prefix_and_encoder_cache"])
def test_randomized_workload_ends_clean(caching: bool) -> None:
    rng = random.Random(7)
    sched = make_sched(num_blocks=33, block_size=4, budget=24, max_num_seqs=6, prefix_caching=caching,
                       encoder_cache_tokens=16 if caching else 0)
    pool = {f"img{i}": 3 + 2 * i for i in range(5)}
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    pending = []
    for i in range(400):
        n_prompt = rng.randint(1, 60)
        items, pos = [], 0
        for h in rng.sample(sorted(pool), rng.randint(0, 2)):
            off = rng.randint(pos, n_prompt)
            if off + pool[h] > n_prompt:
                break
            items.append(image(h, off, pool[h]))
            pos = off + pool[h]
        req = make_req(f"r{i}", n_prompt, max_tokens=rng.randint(1, 20), priority=rng.randint(0, 2),
                       arrival=float(i), mm=items)
        if sched.can_ever_fit(req):
            pending.append(req)
            expected[req.request_id] = expected_output(req.prompt_token_ids, req.sampling_params.max_tokens, items)

    def each_step(_: int) -> None:
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if rng.random() < 0.05 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            assert sched.abort_request(rid) is not None
            aborted.add(rid)

    runner = FakeRunner(sched)
    finished = drive(sched, runner, each_step=each_step)
    while pending:  # drive may stop between arrivals
        each_step(0)
        finished.update(drive(sched, runner, each_step=each_step))
    done = set(finished) - aborted
    assert len(done) > 300 and sched.num_preemptions_total > 0 and len(runner.encoded) > 10
    if caching:
        stats = sched.block_manager.prefix_stats
        assert stats.hits > 1000 and sched.block_manager.num_evicted_blocks > 0
        assert sched.encoder_cache.num_hits > 0 and sched.num_images_skipped > 0
    for rid in done:
        assert finished[rid].output_token_ids == expected[rid], rid


def test_lookahead_slot_holds_the_next_tokens_block_when_blocks_are_plentiful() -> None:
    """With lookahead_slots=1 a decoding request also holds the block of its next token (the runner's decode
    step launched ahead writes there), never on its last step, and never from a scarce pool."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
                      BlockManager(64, 4), EncoderCacheManager(0), max_model_len=0, lookahead_slots=1)
    runner = FakeRunner(sched)
    req = make_req("a", 7, max_tokens=6)
    add(sched, req)
    step(sched, runner)  # prefill of 7 tokens: blocks for 7 tokens, no lookahead
    assert sched.block_manager.num_blocks_of("a") == 2
    step(sched, runner)  # decode at position 7 (block 2) with a slot for position 8: a third block, early
    assert req.num_computed_tokens == 8 and sched.block_manager.num_blocks_of("a") == 3
    finished = drive(sched, runner)
    assert finished["a"].output_token_ids == expected_output(req.prompt_token_ids, 6)
    scarce = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), BlockManager(4, 4),
                       EncoderCacheManager(0), max_model_len=0, lookahead_slots=1)  # 3 usable blocks, 1 running
    r = make_req("b", 7, max_tokens=6)
    add(scarce, r)
    runner = FakeRunner(scarce)
    step(scarce, runner)
    step(scarce, runner)  # one free block for one running request: no surplus, so nothing is taken early
    assert r.num_computed_tokens == 8 and scarce.block_manager.num_blocks_of("b") == 2
    assert drive(scarce, runner)["b"].output_token_ids == expected_output(r.prompt_token_ids, 6)


def test_token_budget_is_live_scheduler_state_and_the_config_is_never_written() -> None:
    sched = make_sched(budget=32)
    add(sched, make_req("a", 100))
    assert sched.token_budget == 32 and splits(sched.schedule()) == [("a", 32)]
    assert sched.set_token_budget(8) == 8 and sched.token_budget == 8
    out = sched.schedule()
    assert splits(out) == [("a", 8)]  # the next step uses the new budget
    assert sched.set_token_budget(10**6) == 32  # never above the configured budget
    assert sched.set_token_budget(0) == 1
    assert sched.config.max_num_batched_tokens == 32


def test_queue_views_and_first_scheduled_time_come_from_the_scheduler() -> None:
    sched = make_sched(max_num_seqs=1)
    add(sched, make_req("run", 4, priority=1), make_req("w1", 4, priority=1), make_req("w0", 4, priority=0))
    sched.requests["run"].group = "gold"
    sched.requests["w1"].group = "bronze"
    assert sched.waiting_by_priority() == {0: 1, 1: 2} and sched.running_groups() == set()
    out = sched.schedule()
    assert ids(out) == ["w0"] and sched.running_request_ids() == ["w0"]
    assert sched.waiting_by_priority() == {1: 2} and sched.running_groups() == set()  # w0 has no group
    assert out.scheduled[0].request.first_scheduled_time is not None
    assert sched.requests["run"].first_scheduled_time is None
    sched.abort_request("w0")
    out = sched.schedule()
    assert ids(out) == ["run"] and sched.running_groups() == {"gold"}


def test_a_stop_string_restates_a_finished_request_but_not_an_aborted_one() -> None:
    sched = make_sched()
    add(sched, make_req("a", 4, max_tokens=1), make_req("b", 4))
    out = sched.schedule()
    (a,) = [r for r in sched.update(out, {"a": 7, "b": 7}) if r.request_id == "a"]
    assert a.status is S.FINISHED_LENGTH
    sched.report_stop_string(a, "</s>")
    assert a.status is S.FINISHED_STOPPED and a.stop_reason == "</s>"
    b = sched.abort_request("b")
    assert b is not None
    with pytest.raises(ValueError):
        sched.report_stop_string(b, "</s>")
    assert b.status is S.FINISHED_ABORTED
