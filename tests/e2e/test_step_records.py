"""The engine's step records on a tiny Qwen2-VL checkpoint (CPU): tokens by kind, vision work on the step that
encodes it, and times that add up to the step's wall time."""

from __future__ import annotations

import numpy as np
import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.engine.stats import StepRecord
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    ckpt = build_qwen2_vl(tmp_path_factory.mktemp("qwen"), seed=5)
    # A small token budget chunks the image prompts, so placeholder ranges straddle step boundaries.
    return LLM(str(ckpt), device="cpu", kv_cache_tokens=4096, max_num_batched_tokens=24,
               enable_prefix_caching=False)


def _array(w: int, h: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _run(llm: LLM, prompts: list, max_tokens: int) -> tuple[list, list[StepRecord]]:
    engine = llm.engine
    engine.step_log = []
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    finally:
        steps, engine.step_log = engine.step_log, None
    return outs, steps


def test_step_records_split_tokens_and_place_vision_work(llm: LLM) -> None:
    prompts = [{"prompt": IMG + "What is in the picture?", "images": [_array(112, 84, 1)]},
               "a text only prompt of a few words",
               {"prompt": IMG + IMG + "Compare.", "images": [_array(56, 56, 2), _array(84, 112, 3)]}]
    outs, steps = _run(llm, prompts, max_tokens=5)
    image_id = llm.engine.model.image_token_id
    merge = llm.engine.checkpoint.hf_config.vision_config.spatial_merge_size
    image_tokens = [sum(1 for t in o.prompt_token_ids if t == image_id) for o in outs]
    prompt_tokens = [len(o.prompt_token_ids) for o in outs]
    assert image_tokens[0] > 0 and image_tokens[1] == 0 and image_tokens[2] > 0
    assert sum(s.num_prefill_image_tokens for s in steps) == sum(image_tokens)
    assert sum(s.num_prefill_text_tokens for s in steps) == sum(prompt_tokens) - sum(image_tokens)
    assert sum(s.num_decode_tokens for s in steps) == 3 * 4  # the first token of each comes from its prefill
    assert max(s.num_prefill_tokens for s in steps) <= 24 < max(prompt_tokens)  # prompts were chunked
    for s in steps:
        assert s.num_decode_tokens == s.num_decode_seqs
        assert s.num_prefill_seqs + s.num_decode_seqs == s.num_seqs
        assert s.num_tokens == s.num_prefill_tokens + s.num_decode_tokens
        assert 0 <= s.num_prefill_image_tokens <= s.num_prefill_tokens
    # Each image is encoded once, on a step that prefills placeholders; its patches are merge^2 per token.
    vision = [s for s in steps if s.num_images]
    assert sum(s.num_images for s in vision) == 3
    assert sum(s.num_image_patches for s in vision) == merge ** 2 * sum(image_tokens)
    assert all(s.num_prefill_image_tokens > 0 and s.vision_s > 0 for s in vision)
    assert all(s.num_image_patches == 0 and s.vision_s == 0 for s in steps if not s.num_images)


def test_step_times_add_up_to_the_step(llm: LLM) -> None:
    _, steps = _run(llm, [{"prompt": IMG + "Time it.", "images": [_array(56, 84, 4)]}, "and a text prompt"], 6)
    assert len(steps) >= 6
    for s in steps:
        assert s.device_s == pytest.approx(s.vision_s + s.forward_s)
        assert 0 < s.device_s <= s.host_s  # on CPU the device work runs inside the step
        assert s.device_s + s.gpu_idle_s == pytest.approx(s.host_s)
        assert s.schedule_s > 0 and s.prepare_s > 0 and s.update_s > 0
        assert s.schedule_s + s.prepare_s + s.device_s + s.update_s <= s.host_s
    for a, b in zip(steps, steps[1:]):
        assert a.start_s + a.host_s <= b.start_s  # steps in order, never overlapping


def test_no_step_log_records_nothing(llm: LLM) -> None:
    assert llm.engine.step_log is None
    llm.generate(["quiet"], SamplingParams(temperature=0.0, max_tokens=2))
    assert llm.engine.step_log is None
