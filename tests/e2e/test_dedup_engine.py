"""dedup in the engine on a tiny Qwen2-VL checkpoint (CPU, float32, greedy): its kept count follows the picture,
per request and as the engine's default; the model-ready floats of GPU preprocessing choose what the compact
image does; two thresholds share the vision work but no KV. The points every strategy shares (transformers on
hand-built inputs, chunked prefill, preemption, bad settings) are in test_pruning.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm.testing.tiny_checkpoints import build_qwen2_vl
from tests.e2e.test_pruning import _count_encoder_calls, _dedup_kept, _greedy, _image, _llm, _prompt, _run, _screenshot


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen_dedup")
    build_qwen2_vl(path, seed=7)
    return str(path)


def test_dedup_per_request_keeps_what_the_picture_needs(qwen: str) -> None:
    """Through LLM.generate's mm_processor_kwargs, on an engine that does not prune: a screenshot keeps few tokens,
    a noisy picture keeps all of them (and is then exactly the unpruned request) or the cap."""
    llm = _llm(qwen)
    shot, noisy = _screenshot(30), _image(31)
    outs = llm.generate([_prompt(shot, mm_token_pruning="dedup", mm_token_keep_ratio=1.0),
                         _prompt(noisy, mm_token_pruning="dedup", mm_token_keep_ratio=1.0),
                         _prompt(noisy, mm_token_pruning="dedup"),
                         _prompt(noisy)], _greedy())
    assert [o.num_image_tokens for o in outs] == [56] * 4
    assert outs[0].num_image_tokens_kept == len(_dedup_kept(shot, 1.0)) == 10 <= 0.30 * 56
    assert [o.num_image_tokens_kept for o in outs[1:]] == [56, 14, 56]  # 14: the default keep ratio's cap
    assert llm.engine.process_prompt(_prompt(noisy, mm_token_pruning="dedup", mm_token_keep_ratio=1.0)) \
        .mm_items[0].pruning is None
    assert outs[1].token_ids == outs[3].token_ids
    # The engine's default, and a request turning it off for a fine-detail question.
    dedup_llm = _llm(qwen, mm_token_pruning="dedup", mm_token_keep_ratio=0.5)
    default, off = dedup_llm.generate([_prompt(shot), _prompt(noisy, mm_token_pruning="none")], _greedy())
    assert default.num_image_tokens_kept == 10 and off.num_image_tokens_kept == 56
    assert off.token_ids == outs[3].token_ids and default.token_ids == outs[0].token_ids


def test_dedup_reads_the_same_pixels_from_model_ready_floats(qwen: str) -> None:
    """--preprocess-on-gpu (here on the CPU device) hands the items model-ready floats, not the compact image:
    dedup reads the levels back from them and keeps the same tokens, and the answers are the same."""
    prompts = [_prompt(_screenshot(60), mm_token_pruning="dedup"), _prompt(_image(61), mm_token_pruning="dedup")]
    compact, floats = _llm(qwen), _llm(qwen, preprocess_on_gpu=True)
    item = floats.engine.process_prompt(prompts[0]).mm_items[0]
    assert item.pixel_values.dtype == torch.float32 and item.pruning.kept.tolist() == \
        compact.engine.process_prompt(prompts[0]).mm_items[0].pruning.kept.tolist()
    want, got = compact.generate(prompts, _greedy()), floats.generate(prompts, _greedy())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.num_image_tokens_kept for o in got] == [10, 14]


def test_two_dedup_thresholds_share_the_vision_work_but_no_kv(qwen: str) -> None:
    # A flat picture with a faint ripple (4 levels) and a detailed window: merged at the default threshold 8, not
    # at 2.
    image = _screenshot(40)
    image[:56] += np.random.default_rng(41).integers(0, 5, (56, 196, 3), dtype=np.uint8)
    loose, strict = (_prompt(image, mm_token_pruning="dedup", mm_token_keep_ratio=1.0, mm_token_dedup_threshold=t)
                     for t in (8, 2))
    assert len(_dedup_kept(image, 1.0)) < len(_dedup_kept(image, 1.0, threshold=2)) < 56
    alone = [_run(_llm(qwen, enable_prefix_caching=False, encoder_cache_tokens=0), [p]) for p in (loose, strict)]
    llm = _llm(qwen)
    calls = _count_encoder_calls(llm)
    outs, logits = _run(llm, [loose, strict])
    assert calls == [1] and llm.engine.runner.kept_tokens.num_selections == 2
    for (want_outs, want_logits), got, got_logits in zip(alone, outs, logits):
        assert got.token_ids == want_outs[0].token_ids
        assert (got_logits - want_logits[0]).abs().max().item() <= 1e-5
    offset = llm.engine.process_prompt(loose).mm_items[0].offset
    again_same, _ = _run(llm, [strict])
    assert again_same[0].num_cached_tokens > offset and again_same[0].token_ids == outs[1].token_ids
    # The same kept tokens under another threshold (an exactly flat margin merges at 8 and at 0): still no KV.
    flat = _screenshot(42)
    assert np.array_equal(_dedup_kept(flat, 1.0), _dedup_kept(flat, 1.0, threshold=0))
    _run(llm, [_prompt(flat, mm_token_pruning="dedup", mm_token_keep_ratio=1.0)])
    other, _ = _run(llm, [_prompt(flat, mm_token_pruning="dedup", mm_token_keep_ratio=1.0,
                                  mm_token_dedup_threshold=0)])
    assert 0 < other[0].num_cached_tokens <= offset
    assert calls == [1, 1]


def test_a_family_without_per_token_pixels_refuses_dedup(qwen: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`token_pixels` is optional in a family's image part: without it, dedup is a ConfigError as the engine's
    default and an InvalidRequestError per request, and the other strategies run."""
    from flashvlm.config import ConfigError
    from flashvlm.processing.qwen_image import QwenImageInputs
    from flashvlm.request import InvalidRequestError

    monkeypatch.delattr(QwenImageInputs, "token_pixels")
    with pytest.raises(ConfigError, match="no per-token pixels"):
        _llm(qwen, mm_token_pruning="dedup")
    llm = _llm(qwen)
    with pytest.raises(InvalidRequestError, match="no per-token pixels"):
        llm.generate([_prompt(_screenshot(70), mm_token_pruning="dedup")], _greedy(2))
    out = llm.generate([_prompt(_screenshot(70), mm_token_pruning="pool")], _greedy(2))[0]
    assert out.num_image_tokens_kept == 14
