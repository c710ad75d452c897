"""SamplingParams.n on a tiny Qwen2-VL checkpoint (CPU, float32): one request, n completions, the prompt (image
included) computed once and its KV shared; seeded samples repeat exactly, greedy samples equal the n=1 answer; abort
and preemption leave no block behind."""

from __future__ import annotations

import numpy as np
import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.request import MAX_NUM_SAMPLES, InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
BS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_qwen2_vl(tmp_path_factory.mktemp("qwen-n"), seed=5))


def _llm(ckpt: str, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    return LLM(ckpt, device="cpu", dtype="float32", block_size=BS, **kw)


@pytest.fixture(scope="module")
def llm(ckpt: str) -> LLM:
    return _llm(ckpt)


def _prompt(seed: int, text: str = "Describe the picture in a few words, please.") -> dict:
    image = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    return {"prompt": IMG + text, "images": [image]}


def _sampled(n: int, seed: int | None = None, max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, n=n, seed=seed, max_tokens=max_tokens, ignore_eos=True, **kw)


def _assert_clean(llm: LLM) -> None:
    sched = llm.engine.scheduler
    bm = sched.block_manager
    bm.check_invariants()
    sched.encoder_cache.check_invariants()
    assert bm.num_free_blocks == bm.num_usable_blocks and not sched.requests
    assert llm.engine.unfinished_request_ids() == []


def test_prompt_is_computed_once_for_n_samples(llm: LLM) -> None:
    prompt = _prompt(11)
    before = llm.engine.stats()
    (out,) = llm.generate(prompt, _sampled(4, seed=1))
    after = llm.engine.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    p = len(out.prompt_token_ids)
    shared = (p - 1) // BS * BS  # the full blocks a sibling can share: at least one token is left to compute
    assert shared >= p - BS and shared > 0
    queried = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hit = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert queried == 4 * p and hit == 3 * shared, "samples 1..3 must take the prompt's blocks from sample 0"
    computed = queried - hit
    assert computed == p + 3 * (p - shared) < 2 * p  # once, plus each sibling's last partial block
    assert out.num_cached_tokens == 0  # the prompt was new: sample 0 computed it
    assert after["images_encoded"] - before["images_encoded"] == 1
    assert after["images_skipped_by_prefix_cache"] - before["images_skipped_by_prefix_cache"] == 3
    _assert_clean(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefill_tokens_once_with_or_without_prefix_caching(ckpt: str, prefix_caching: bool) -> None:
    # Without prefix caching the samples share sample 0's full prompt blocks directly.
    fresh = _llm(ckpt, enable_prefix_caching=prefix_caching)
    fresh.engine.step_log = []
    prompt = _prompt(21, "A longer question about the picture, so that the prompt spans several blocks of KV.")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (four,) = fresh.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=4))
    p = len(four.prompt_token_ids)
    shared = (p - 1) // BS * BS
    assert sum(r.num_prefill_tokens for r in fresh.engine.step_log) == p + 3 * (p - shared) < 2 * p
    assert sum(r.num_images for r in fresh.engine.step_log) == 1
    assert fresh.engine.stats()["images_encoded"] == 1
    _assert_clean(fresh)
    fresh.engine.step_log = None
    cold = _llm(ckpt, enable_prefix_caching=False, encoder_cache_tokens=0)
    assert [c.token_ids for c in four.outputs] == [cold.generate(prompt, greedy)[0].token_ids] * 4


def test_seeded_samples_repeat_exactly_and_differ_from_each_other(llm: LLM) -> None:
    prompt = _prompt(12)
    first = llm.generate(prompt, _sampled(4, seed=123))[0]
    again = llm.generate(prompt, _sampled(4, seed=123))[0]
    samples = [c.token_ids for c in first.outputs]
    assert [c.token_ids for c in again.outputs] == samples
    assert [c.text for c in again.outputs] == [c.text for c in first.outputs]
    assert len({tuple(s) for s in samples}) == 4, "each sample draws from its own derived seed"
    # Sample 0 keeps the request's seed: it is the n=1 answer for that seed.
    assert llm.generate(prompt, _sampled(1, seed=123))[0].token_ids == samples[0]
    other = llm.generate(prompt, _sampled(4, seed=124))[0]
    assert [c.token_ids for c in other.outputs] != samples
    # Batched with other requests, the seeded samples still repeat.
    batch = llm.generate([_prompt(13), prompt, {"prompt": "Once upon a time"}],
                         [_sampled(2), _sampled(4, seed=123), _sampled(3, seed=5)])
    assert [c.token_ids for c in batch[1].outputs] == samples
    _assert_clean(llm)


def test_unseeded_samples_differ(llm: LLM) -> None:
    out = llm.generate(_prompt(14), _sampled(4, max_tokens=10))[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4


def test_greedy_n_gives_n_copies_of_the_n1_answer(ckpt: str, llm: LLM) -> None:
    prompt = _prompt(15)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    one = llm.generate(prompt, greedy)[0]
    four = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, n=4))[0]
    assert [c.token_ids for c in four.outputs] == [one.token_ids] * 4
    assert [c.text for c in four.outputs] == [one.text] * 4
    cold = _llm(ckpt, enable_prefix_caching=False, encoder_cache_tokens=0)  # no sharing: the reference
    assert cold.generate(prompt, greedy)[0].token_ids == one.token_ids
    _assert_clean(llm)


def test_request_output_fields_read_the_first_completion(llm: LLM) -> None:
    out = llm.generate(_prompt(16), _sampled(3, seed=9, logprobs=2))[0]
    assert out.finished and out.text == out.outputs[0].text and out.token_ids == out.outputs[0].token_ids
    assert out.finish_reason == "length" and out.num_output_tokens == 3 * 8
    for c in out.outputs:
        assert c.logprobs is not None and [e.token_id for e in c.logprobs] == c.token_ids
        assert all(len(e.top) == 2 for e in c.logprobs)
    assert out.first_token_time is not None and out.finish_time is not None
    assert out.finish_time >= out.first_token_time >= out.arrival_time
    assert set(out.stages) >= {"queue", "prefill", "decode"}


def test_stats_count_one_request_and_abort_ends_every_sample(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request(_prompt(17), _sampled(4, max_tokens=50), request_id="fan", priority=2)
    stats = eng.stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 1) and eng.waiting_by_priority() == {2: 1}
    seen = []
    for _ in range(4):
        outs = eng.step()
        stats = eng.stats()
        seen.append((stats["num_running"], stats["num_waiting"]))
        assert [o.request_id for o in outs] in ([], ["fan"])
    assert seen[0] == (1, 0) and all(s == (1, 0) for s in seen), seen
    assert eng.running_request_ids() == ["fan"] and eng.unfinished_request_ids() == ["fan"]
    assert eng.waiting_by_priority() == {}  # a request waits only while none of its samples runs
    assert len(eng.scheduler.requests) == 4
    out = eng.abort_request("fan")
    assert out is not None and out.finished and len(out.outputs) == 4
    assert all(c.finish_reason == "abort" and 0 < len(c.token_ids) < 50 for c in out.outputs)
    assert eng.abort_request("fan") is None
    _assert_clean(llm)


def test_sample_ids_never_collide(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("hello", _sampled(1), request_id="x#1")
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("hello", _sampled(2), request_id="x")
    eng.abort_request("x#1")
    eng.add_request("hello", _sampled(2), request_id="x")
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("hello", _sampled(1), request_id="x#1")
    eng.abort_request("x")
    _assert_clean(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_samples_resume_and_match_greedy(ckpt: str, prefix_caching: bool) -> None:
    # 12 blocks of 8: four samples of 13 + 40 tokens cannot all hold their KV at once.
    small = _llm(ckpt, kv_cache_tokens=12 * BS, enable_prefix_caching=prefix_caching)
    prompt = {"prompt": "The quick brown fox jumps over the lazy dog"}
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    one = small.generate(prompt, SamplingParams(**greedy))[0]
    four = small.generate(prompt, SamplingParams(**greedy, n=4))[0]
    assert small.engine.stats()["num_preemptions"] > 0
    assert [c.token_ids for c in four.outputs] == [one.token_ids] * 4
    seeded = [small.generate(prompt, _sampled(4, seed=3, max_tokens=40))[0] for _ in range(2)]
    assert [c.token_ids for c in seeded[0].outputs] == [c.token_ids for c in seeded[1].outputs]
    _assert_clean(small)


@pytest.mark.parametrize("n", [0, -1, MAX_NUM_SAMPLES + 1, 2.0, True, "2", None])
def test_bad_n_is_refused(n) -> None:
    with pytest.raises(InvalidRequestError, match="n must be an integer"):
        SamplingParams(n=n)
