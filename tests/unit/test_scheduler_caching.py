"""Scheduler with prefix caching and an encoder-cache budget, driven by test_scheduler's fake runner.

The fake runner's KV cache stores image placeholders as values naming their picture, so a hit on a block
holding another picture, or a write into a shared or cached block, fails its checks.
"""

from __future__ import annotations

import random

import pytest
from test_scheduler import FakeRunner, drive, expected_output, ids, image, make_sched, step

from flashvlm.request import MMItem, Request, RequestStatus, SamplingParams


def req_of(rid: str, tokens: list[int], mm: list[MMItem] | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), mm_items=mm or [])


def caching_sched(**kw) -> tuple:
    kw.setdefault("prefix_caching", True)
    sched = make_sched(**kw)
    return sched, FakeRunner(sched)


def twin(rid: str, prompt: list[int], mm: list[MMItem] | None = None, max_tokens: int = 3) -> Request:
    return req_of(rid, prompt, mm, max_tokens=max_tokens)


def run_alone(sched, runner, req: Request) -> Request:
    sched.add_request(req)
    finished = drive(sched, runner)
    assert finished[req.request_id].output_token_ids == expected_output(
        req.prompt_token_ids, req.sampling_params.max_tokens, req.mm_items)
    return req


def test_same_image_twice_skips_encoder_and_prefill() -> None:
    sched, runner = caching_sched(encoder_cache_tokens=0)
    prompt = list(range(1, 31))
    first = run_alone(sched, runner, twin("a", prompt, [image("X", 4, 12)]))
    assert first.num_cached_tokens == 0 and runner.encoded == ["X"]
    second = twin("b", prompt[:28] + [77, 78], [image("X", 4, 12)])
    sched.add_request(second)
    out, _ = step(sched, runner)
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(28, 2)]
    assert out.encoder_inputs == {}  # X's placeholders [4, 16) are inside the 28-token hit
    drive(sched, runner)
    assert second.num_cached_tokens == 28 and runner.encoded == ["X"] and sched.num_images_skipped == 1
    stats = sched.block_manager.prefix_stats
    assert (stats.queries, stats.hits) == (60, 28)


def test_different_images_behind_identical_tokens_do_not_share() -> None:
    sched, runner = caching_sched()
    prompt = list(range(1, 31))
    run_alone(sched, runner, twin("a", prompt, [image("X", 6, 12)]))
    other = run_alone(sched, runner, twin("b", prompt, [image("Y", 6, 12)]))
    assert other.num_cached_tokens == 4  # only the text block before the image
    assert runner.encoded == ["X", "Y"]


def test_same_image_at_another_position_shares_only_the_common_prefix() -> None:
    sched, runner = caching_sched(encoder_cache_tokens=100)
    run_alone(sched, runner, twin("a", list(range(1, 31)), [image("X", 8, 12)]))
    moved = run_alone(sched, runner, twin("b", list(range(1, 9)) + [50, 51] + list(range(9, 31)),
                                          [image("X", 10, 12)]))
    assert moved.num_cached_tokens == 8  # the two blocks before the point where the prompts part
    assert runner.encoded == ["X"] and sched.encoder_cache.num_hits == 1  # the embedding is reused


def test_partly_covered_image_uses_cached_embedding_or_encodes() -> None:
    for budget, encodes in ((100, ["X"]), (0, ["X", "X"])):
        sched, runner = caching_sched(encoder_cache_tokens=budget)
        run_alone(sched, runner, twin("a", list(range(1, 31)), [image("X", 6, 12)]))
        b = twin("b", list(range(1, 15)) + [60 + i for i in range(16)], [image("X", 6, 12)])
        sched.add_request(b)
        out, _ = step(sched, runner)
        assert out.scheduled[0].start == 12  # the hit ends inside X's placeholders [6, 18)
        assert out.encoder_inputs == ({} if budget else {"b": [0]})
        drive(sched, runner)
        assert runner.encoded == encodes


def test_cached_tokens_cost_no_budget_and_chunks_hash_when_full() -> None:
    sched, runner = caching_sched(budget=6)
    a = twin("a", list(range(1, 24)), max_tokens=2)
    sched.add_request(a)
    cached = []
    for _ in range(4):  # chunks of 6: [0,6) [6,12) [12,18) [18,23)
        step(sched, runner)
        cached.append(sched.block_manager.num_cached_blocks)
    assert cached == [1, 3, 4, 5]  # a block enters the index only once all its tokens are computed
    drive(sched, runner)
    b = twin("b", list(range(1, 24)), max_tokens=2)
    sched.add_request(b)
    out, _ = step(sched, runner)
    # 20 of 23 tokens cached; the 3 left fit the 6-token budget and sample at once.
    assert [(s.start, s.num_new_tokens, s.samples) for s in out.scheduled] == [(20, 3, True)]
    drive(sched, runner)
    assert b.output_token_ids == a.output_token_ids


def test_identical_requests_in_one_step_compute_twice_then_share() -> None:
    sched, runner = caching_sched()
    reqs = [twin(f"r{i}", list(range(1, 20)), [image("X", 2, 9)]) for i in range(3)]
    sched.add_request(reqs[0])
    sched.add_request(reqs[1])
    step(sched, runner)  # both miss: admitted before either computed anything
    sched.add_request(reqs[2])
    drive(sched, runner)
    assert [r.num_cached_tokens for r in reqs] == [0, 0, 16]
    assert all(r.output_token_ids == reqs[0].output_token_ids for r in reqs)


def test_twin_waits_for_blocks_in_flight_then_hits_while_others_go_first() -> None:
    """With shared_prefix_wait_tokens on, a request whose next blocks a running request is computing waits
    (letting an unrelated request behind it start) and is then admitted onto the cached blocks."""
    sched, runner = caching_sched(shared_prefix_wait_tokens=8)
    a, b = (twin(r, list(range(1, 20)), [image("X", 2, 9)]) for r in "ab")
    other = twin("c", list(range(40, 52)))
    for r in (a, b, other):
        sched.add_request(r)
    out, _ = step(sched, runner)
    assert ids(out) == ["a", "c"]  # b waits: a is computing its 4 full blocks right now
    assert sched.block_manager.num_in_flight_hashes == 0  # a's prompt is done, its blocks cached
    out, _ = step(sched, runner)
    assert [(s.request.request_id, s.start) for s in out.scheduled if s.request is b] == [("b", 16)]
    drive(sched, runner)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 16) and runner.encoded == ["X"]
    assert b.output_token_ids == a.output_token_ids == expected_output(a.prompt_token_ids, 3, a.mm_items)


def test_short_shared_run_does_not_wait() -> None:
    """Below the threshold (here 2 shared blocks of 4 against a wait of 12 tokens) both start at once."""
    sched, runner = caching_sched(shared_prefix_wait_tokens=12)
    a, b = twin("a", list(range(1, 10))), twin("b", list(range(1, 9)) + [70, 71])
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert ids(out) == ["a", "b"]


def test_waiting_twin_is_admitted_when_the_owner_is_preempted() -> None:
    """The owner of the in-flight blocks is preempted before computing them: its claim goes with it, so
    the waiter is admitted instead of waiting on blocks nobody is computing."""
    sched, runner = caching_sched(shared_prefix_wait_tokens=8, budget=8, num_blocks=12)
    low = twin("low", list(range(1, 30)), max_tokens=2)
    low.priority = 1
    sched.add_request(low)
    step(sched, runner)  # low computes its first 8 tokens; 20 more (5 blocks) are in flight
    assert sched.block_manager.num_in_flight_hashes == 5
    twin_of_low = twin("twin", list(range(1, 30)), max_tokens=2)
    twin_of_low.priority = 1
    sched.add_request(twin_of_low)
    out, _ = step(sched, runner)
    assert ids(out) == ["low"]  # the twin waits for low's blocks
    hog = twin("hog", list(range(100, 130)), max_tokens=2)  # priority 0 needs the whole cache
    sched.add_request(hog)
    finished = drive(sched, runner)
    assert low.num_preemptions >= 1
    for r in (low, twin_of_low, hog):
        assert finished[r.request_id].output_token_ids == expected_output(r.prompt_token_ids, 2)
    assert sched.block_manager.num_in_flight_hashes == 0


def test_preempting_a_request_that_holds_shared_blocks() -> None:
    sched, runner = caching_sched(num_blocks=10, block_size=4, budget=64)  # 36 tokens of KV
    prompt = list(range(1, 18))
    a = twin("a", prompt, [image("X", 1, 8)], max_tokens=12)
    sched.add_request(a)
    step(sched, runner)  # a: 17 tokens, 5 blocks, 4 of them cached
    b = twin("b", prompt[:16] + [90], [image("X", 1, 8)], max_tokens=12)
    sched.add_request(b)
    out, _ = step(sched, runner)
    assert b.num_cached_tokens == 16 and out.scheduled[-1].start == 16
    shared = sched.block_manager.get_block_ids("b")[:4]
    assert shared == sched.block_manager.get_block_ids("a")[:4]
    # Both grow until the cache is full and b (the later arrival) is preempted.
    for _ in range(20):
        step(sched, runner)
        if b.num_preemptions:
            break
    assert b.status is RequestStatus.PREEMPTED
    assert all(sched.block_manager.blocks[i].ref_cnt == 1 for i in shared)  # a keeps them
    finished = drive(sched, runner)
    for r in (a, b):
        assert finished[r.request_id].output_token_ids == expected_output(r.prompt_token_ids, 12, r.mm_items)
    assert b.num_cached_tokens == 16  # the first admission's figure; resumption does not overwrite it
    assert sched.block_manager.prefix_stats.num_lookups == 3


def test_resumed_request_hits_its_own_prompt_and_outputs() -> None:
    sched, runner = caching_sched(num_blocks=9, block_size=4, budget=64)  # 32 tokens of KV
    a = twin("a", list(range(1, 12)), max_tokens=12)
    b = twin("b", list(range(50, 61)), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    lookups = []
    orig = sched.block_manager.find_cached_prefix

    def spy(req):
        hit = orig(req)
        lookups.append((req.request_id, req.num_tokens, len(hit) * 4))
        return hit

    sched.block_manager.find_cached_prefix = spy
    drive(sched, runner)
    resumed = [x for x in lookups if x[0] == "b"][1:]
    assert b.num_preemptions > 0 and resumed
    assert any(n > 11 and hit > 8 for _, n, hit in resumed)  # outputs' blocks came back from the cache
    assert b.output_token_ids == expected_output(b.prompt_token_ids, 12)


def test_eviction_under_pressure_keeps_outputs_exact() -> None:
    sched, runner = caching_sched(num_blocks=9, block_size=4, budget=16, max_num_seqs=3)
    prompts = [list(range(1, 14)), list(range(30, 45)), list(range(1, 10)) + [70, 71, 72]]
    reqs = []
    for i in range(12):
        r = twin(f"r{i}", prompts[i % 3], [image(f"img{i % 2}", 2, 5)], max_tokens=6)
        reqs.append(r)
        sched.add_request(r)
        if i % 3 == 2:
            drive(sched, runner)
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 6, r.mm_items)
    bm = sched.block_manager
    assert bm.prefix_stats.hits > 0 and bm.num_evicted_blocks > 0


def test_make_room_does_not_count_prefix_blocks_as_reclaimable() -> None:
    sched, runner = caching_sched(num_blocks=7, block_size=4, budget=64)  # 6 usable blocks
    mid = Request("mid", list(range(60, 67)), SamplingParams(max_tokens=5), priority=0, arrival_time=0)
    low = Request("low", list(range(1, 9)) + [30] * 7, SamplingParams(max_tokens=5), priority=1, arrival_time=1)
    sched.add_request(mid)
    sched.add_request(low)
    step(sched, runner)  # mid: 2 blocks, low: 4 blocks (its first 2 cached), none free
    new = Request("new", list(range(1, 9)) + [40] * 9, SamplingParams(max_tokens=2), priority=0, arrival_time=2)
    sched.add_request(new)
    out, _ = step(sched, runner)
    # new would share low's 2 cached blocks and need 3 more. Preempting low frees 4, but 2 of them are the
    # very prefix new takes back: only 2 are gained, so low must not be preempted for nothing.
    assert low.num_preemptions == 0 and [s.request.request_id for s in out.scheduled] == ["mid", "low"]
    finished = drive(sched, runner)
    assert new.num_cached_tokens == 8
    for r in (mid, low, new):
        assert finished[r.request_id].output_token_ids == expected_output(
            r.prompt_token_ids, r.sampling_params.max_tokens)


@pytest.mark.parametrize("wait", [0, 8])
def test_long_random_workload_with_caching_returns_every_reference(wait: int) -> None:
    """1,200+ requests over shared stems and a small image pool, with aborts, priorities and preemption:
    exact outputs, consistent bookkeeping every step, and nothing held at the end; also with requests
    waiting for blocks in flight."""
    rng = random.Random(11)
    sched, runner = caching_sched(num_blocks=41, block_size=4, budget=20, max_num_seqs=6, encoder_cache_tokens=12,
                                  shared_prefix_wait_tokens=wait)
    stems = [[rng.randrange(10, 90) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    pool = {f"img{i}": 2 + 3 * i for i in range(5)}
    pending, expected, aborted = [], {}, set()
    for i in range(1200):
        prompt = list(rng.choice(stems)) + [rng.randrange(10, 90) for _ in range(rng.randint(0, 10))]
        items = []
        if rng.random() < 0.7:
            h = rng.choice(sorted(pool))
            off = rng.randint(0, len(prompt))
            prompt[off:off] = [5] * pool[h]
            items = [image(h, off, pool[h])]
        req = Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 10)), mm_items=items,
                      priority=rng.randint(0, 1), arrival_time=float(i))
        if sched.can_ever_fit(req):
            pending.append(req)
            expected[req.request_id] = expected_output(prompt, req.sampling_params.max_tokens, items)

    def each_step(_: int) -> None:
        for _ in range(rng.randint(0, 3)):
            if pending:
                sched.add_request(pending.pop(0))
        if rng.random() < 0.03 and sched.requests:
            rid = rng.choice(sorted(sched.requests))
            sched.abort_request(rid)
            aborted.add(rid)

    finished = drive(sched, runner, each_step=each_step)
    while pending:
        each_step(0)
        finished.update(drive(sched, runner, each_step=each_step))
    done = set(finished) - aborted
    assert len(done) > 1100
    for rid in done:
        assert finished[rid].output_token_ids == expected[rid], rid
    bm, enc = sched.block_manager, sched.encoder_cache
    assert all(b.ref_cnt == 0 for b in bm.blocks) and bm.num_free_blocks == bm.num_usable_blocks
    assert not bm._req_blocks and not bm._req_hashes and not bm._num_hashed and bm.num_in_flight_hashes == 0
    assert enc.num_referenced == 0 and runner.embeddings == enc.held_hashes()
    assert bm.prefix_stats.hit_rate > 0.2 and bm.num_evicted_blocks > 0 and sched.num_preemptions_total > 0
    assert enc.num_hits > 0 and enc.num_evictions > 0 and sched.num_images_skipped > 0


def test_a_better_twin_does_not_wait_on_a_prefill_it_defers() -> None:
    """A waiting request better than a running prefill defers that prefill's next chunk; it must not also wait for
    the blocks that prefill is computing (steady traffic in between could then hold both back for ever): it is
    admitted at once, on the blocks already cached."""
    sched, runner = caching_sched(shared_prefix_wait_tokens=8, budget=8)
    prompt = list(range(1, 41))
    owner = Request("owner", list(prompt), SamplingParams(max_tokens=3), priority=2)
    sched.add_request(owner)
    step(sched, runner)  # the owner's first chunk: 8 of its 40 tokens
    better = Request("better", prompt[:36] + [90, 91], SamplingParams(max_tokens=3), priority=0, arrival_time=1.0)
    sched.add_request(better)
    out, _ = step(sched, runner)
    assert ids(out) == ["better"] and out.scheduled[0].start == 8  # on the owner's 2 cached blocks
    drive(sched, runner)
    assert better.output_token_ids == expected_output(better.prompt_token_ids, 3, [])
    assert owner.output_token_ids == expected_output(owner.prompt_token_ids, 3, [])
