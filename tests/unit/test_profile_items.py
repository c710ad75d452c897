"""The stand-in image batch the GPU memory profile runs through the vision tower: the heaviest a step can hold."""

from __future__ import annotations

from flashvlm import LLM
from flashvlm.testing.tiny_checkpoints import build_llava, build_qwen2_vl


def test_qwen_profiles_the_largest_allowed_image(tmp_path) -> None:
    llm = LLM(str(build_qwen2_vl(tmp_path / "q", seed=1)), device="cpu", kv_cache_tokens=2048)
    proc = llm.engine.input_processor.image_processor
    items = llm.engine.input_processor.profile_items(budget_tokens=32)
    assert len(items) == 1  # one max-size image outweighs the whole budget
    t, h, w = items[0].grid_thw
    assert h * w * proc.patch_size ** 2 <= proc.max_pixels
    assert (h + proc.merge_size) * (w + proc.merge_size) * proc.patch_size ** 2 > proc.max_pixels  # the largest
    embeddings = llm.engine.runner.model.encode_images(items)
    assert embeddings[0].shape[0] == items[0].num_tokens


def test_fixed_size_towers_profile_a_budget_of_images(tmp_path) -> None:
    llm = LLM(str(build_llava(tmp_path / "l", seed=1)), device="cpu", kv_cache_tokens=2048)
    items = llm.engine.input_processor.profile_items(budget_tokens=100)
    assert len(items) == 100 // items[0].num_tokens
    assert [e.shape[0] for e in llm.engine.runner.model.encode_images(items[:2])] == [items[0].num_tokens] * 2
