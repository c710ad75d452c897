"""SamplingParams.logprobs through LLM.generate / chat on a tiny Qwen2-VL checkpoint (float32, CPU): every
returned value is the log_softmax of the logits the model produced for that step (the runner's record_logits
hook), the top-k is the reference's, and asking for logprobs changes no token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.request import MAX_LOGPROBS, InvalidRequestError, TokenLogprobs
from flashvlm.runner.logprobs import gather_logprobs, read_back
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
TOL = 1e-5


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = build_qwen2_vl(tmp_path_factory.mktemp("qwen-logprobs"), seed=5)
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=4096)


def _prompts() -> list[dict]:
    image = np.random.default_rng(2).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    return [{"prompt": IMG + "Describe the picture.", "images": [image]}, {"prompt": "Once upon a time"},
            {"prompt": "The quick brown fox jumps"}]


def _check_against_logits(entries: list[TokenLogprobs], token_ids: list[int], logits: list[torch.Tensor],
                          num_top: int) -> None:
    assert len(entries) == len(token_ids) == len(logits)
    for entry, token, row in zip(entries, token_ids, logits):
        reference = row.float().log_softmax(dim=-1)
        assert entry.token_id == token
        assert abs(entry.logprob - reference[token].item()) <= TOL
        assert len(entry.top) == num_top
        values, ids = reference.topk(num_top)
        got_ids = [t for t, _ in entry.top]
        got_values = [v for _, v in entry.top]
        assert got_values == sorted(got_values, reverse=True)
        assert np.allclose(got_values, values.tolist(), atol=TOL, rtol=0)
        assert all(abs(reference[t].item() - v) <= TOL for t, v in entry.top)
        assert got_ids == ids.tolist()
        if token in got_ids:  # the sampled token's entry in the top-k is its own logprob
            assert abs(dict(entry.top)[token] - entry.logprob) <= TOL


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5),
    # Sampling transforms change the token drawn, never the reported values (raw logits, as vLLM).
    SamplingParams(temperature=0.8, top_p=0.7, top_k=20, repetition_penalty=1.3, seed=3, max_tokens=6,
                   ignore_eos=True, logprobs=MAX_LOGPROBS),
    SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0),
], ids=["greedy", "sampled-with-transforms", "sampled-token-only"])
def test_logprobs_are_the_raw_logits_log_softmax(llm: LLM, params: SamplingParams) -> None:
    runner = llm.engine.runner
    runner.record_logits = True
    runner.recorded_logits.clear()
    try:
        outs = llm.generate(_prompts(), params)
    finally:
        runner.record_logits = False
    for out in outs:
        assert out.logprobs is not None
        _check_against_logits(out.logprobs, out.token_ids, runner.recorded_logits[out.request_id], params.logprobs)
        if params.greedy and params.logprobs:
            assert all(e.top[0][0] == e.token_id for e in out.logprobs)  # greedy picks the most likely token


def test_logprobs_change_no_token(llm: LLM) -> None:
    prompts = _prompts()
    for temperature in (0.0, 0.9):
        plain = SamplingParams(temperature=temperature, seed=11, max_tokens=8, ignore_eos=True)
        asking = SamplingParams(temperature=temperature, seed=11, max_tokens=8, ignore_eos=True, logprobs=3)
        before = llm.generate(prompts, plain)
        # A batch where only some rows ask: the others are untouched too.
        mixed = llm.generate(prompts, [asking, plain, asking])
        assert [o.token_ids for o in mixed] == [o.token_ids for o in before]
        assert [o.logprobs is None for o in mixed] == [False, True, False]
        assert all(o.logprobs is None for o in before)


def test_chat_returns_logprobs(llm: LLM) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    out = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2))[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 3
    assert [e.token_id for e in out.logprobs] == out.token_ids


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0, "5"])
def test_logprobs_out_of_range_is_refused(bad: object) -> None:
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=bad)


def test_gather_on_a_subset_of_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    tokens = torch.randint(0, 300, (4,))
    params = [SamplingParams(logprobs=2), SamplingParams(), SamplingParams(logprobs=7), SamplingParams()]
    token_list, entries = read_back(tokens, gather_logprobs(logits, tokens, ["a", "b", "c", "d"], params))
    assert token_list == tokens.tolist() and set(entries) == {"a", "c"}
    for rid, row, k in (("a", 0, 2), ("c", 2, 7)):
        _check_against_logits([entries[rid]], [token_list[row]], [logits[row]], k)
    assert read_back(tokens, gather_logprobs(logits, tokens, list("abcd"), [SamplingParams()] * 4)) == (
        tokens.tolist(), {})


def test_preempted_requests_keep_one_entry_per_token(tmp_path) -> None:
    # A KV cache too small for the batch preempts and recomputes requests; their logprobs stay aligned with the
    # tokens (the recompute's prefill samples the next token, not one already given).
    path = build_qwen2_vl(tmp_path / "m", seed=5)
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=160, block_size=16, max_model_len=128)
    prompts = [f"Request number {i} asks for a long answer" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    runner = llm.engine.runner
    runner.record_logits = True
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["num_preemptions"] > 0
    for out in outs:
        _check_against_logits(out.logprobs, out.token_ids, runner.recorded_logits[out.request_id], 2)
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
