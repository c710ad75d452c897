"""Prefix caching and the encoder cache on tiny checkpoints (CPU, float32, greedy): outputs must equal an engine
with both caches off, while the cached engine skips the work it can."""

from __future__ import annotations

import numpy as np
import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.testing.tiny_checkpoints import build_fuyu, build_llava, build_llava_next, build_qwen2_vl, build_qwen3_vl

PLACEHOLDER = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>\n",
               "llava_next": "<image>\n", "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
               "fuyu": "|SPEAKER|"}
IMAGE_FIRST = ("fuyu",)
"""Families whose prompt puts the image before all text (FuyuProcessor's layout)."""
BS = 8


# qwen3_vl: its DeepStack features ride in the cached embedding rows.
@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl", "llava", "llava_next", "fuyu"])
def family(request, tmp_path_factory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        build_llava(path, seed=5)
    elif request.param == "llava_next":
        build_llava_next(path, seed=5)
    elif request.param == "qwen3_vl":
        build_qwen3_vl(path, seed=5)
    elif request.param == "fuyu":
        build_fuyu(path, seed=5)
    else:
        build_qwen2_vl(path, seed=5)
    return request.param, str(path)


def _pair(family: tuple[str, str], **kw) -> tuple[LLM, LLM]:
    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("block_size", BS)
    on = LLM(family[1], device="cpu", dtype="float32", **kw)
    kw.update(enable_prefix_caching=False, encoder_cache_tokens=0)
    off = LLM(family[1], device="cpu", dtype="float32", **kw)
    return on, off


def _image(seed: int, w: int = 112, h: int = 140) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _prompt(family: tuple[str, str], before: str, image: np.ndarray, after: str) -> dict:
    if family[0] in IMAGE_FIRST:
        return {"prompt": PLACEHOLDER[family[0]] + before + after, "images": [image]}
    return {"prompt": before + PLACEHOLDER[family[0]] + after, "images": [image]}


def _greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _both(on: LLM, off: LLM, prompts: list[dict], params: SamplingParams | None = None) -> list:
    params = params or _greedy()
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(o.num_cached_tokens == 0 for o in want)
    return got


def _placeholder_offset(llm: LLM, prompt: dict) -> int:
    return llm.engine.process_prompt(prompt).mm_items[0].offset


def _assert_clean(llm: LLM) -> None:
    sched = llm.engine.scheduler
    bm, enc = sched.block_manager, sched.encoder_cache
    bm.check_invariants()
    enc.check_invariants()
    assert all(b.ref_cnt == 0 for b in bm.blocks) and bm.num_free_blocks == bm.num_usable_blocks
    assert enc.num_referenced == 0


def test_same_image_twice(family) -> None:
    on, off = _pair(family)
    img = _image(1)
    first = _both(on, off, [_prompt(family, "Look: ", img, "Describe the picture in one sentence.")])[0]
    stats = on.engine.stats()
    assert first.num_cached_tokens == 0 and stats["images_encoded"] == 1
    second = _both(on, off, [_prompt(family, "Look: ", img, "What colour is the shape?")])[0]
    stats = on.engine.stats()
    assert second.num_cached_tokens > 0 and second.num_cached_tokens % BS == 0
    assert stats["images_encoded"] == 1, "the repeated image must not run the vision tower again"
    assert stats["encoder_cache_hits"] + stats["images_skipped_by_prefix_cache"] >= 1
    assert stats["prefix_cache_hits"] == second.num_cached_tokens
    assert off.engine.stats()["images_encoded"] == 2
    _assert_clean(on)


def test_fully_cached_image_needs_no_encoder_even_without_encoder_cache(family) -> None:
    on, off = _pair(family, encoder_cache_tokens=0)
    prompt = _prompt(family, "", _image(2), "Describe the image in one sentence. The quick brown fox jumps.")
    _both(on, off, [prompt])
    again = _both(on, off, [prompt])[0]
    item = on.engine.process_prompt(prompt).mm_items[0]
    assert again.num_cached_tokens >= item.end
    stats = on.engine.stats()
    assert stats["images_encoded"] == 1 and stats["images_skipped_by_prefix_cache"] == 1
    assert stats["encoder_cache_entries"] == 0


def test_different_images_behind_identical_token_ids_do_not_share(family) -> None:
    on, off = _pair(family)
    text_before = "The quick brown fox jumps over the lazy dog. "
    a = _prompt(family, text_before, _image(3), "What is in the picture?")
    b = _prompt(family, text_before, _image(4), "What is in the picture?")
    assert on.engine.process_prompt(a).prompt_token_ids == on.engine.process_prompt(b).prompt_token_ids
    _both(on, off, [a])
    out_b = _both(on, off, [b])[0]
    assert out_b.num_cached_tokens == _placeholder_offset(on, b) // BS * BS  # only the text before the image
    assert on.engine.stats()["images_encoded"] == 2


def test_same_image_at_another_position(family) -> None:
    if family[0] in IMAGE_FIRST:
        pytest.skip("the image always leads this family's prompt")
    on, off = _pair(family)
    img = _image(5)
    a = _prompt(family, "Hi. ", img, "What colour is the shape?")
    b = _prompt(family, "The quick brown fox jumps over the lazy dog. Now: ", img, "What colour is the shape?")
    _both(on, off, [a])
    out_b = _both(on, off, [b])[0]
    assert out_b.num_cached_tokens < _placeholder_offset(on, b)
    stats = on.engine.stats()
    assert stats["images_encoded"] == 1 and stats["encoder_cache_hits"] == 1  # KV differs, the embedding not


def test_multi_turn_follow_up_reuses_the_earlier_turn(family) -> None:
    if family[0] in IMAGE_FIRST:
        pytest.skip("no chat template (adept/fuyu-8b has none)")
    on, off = _pair(family, block_size=16)
    img = _image(6)
    turn1 = [{"role": "user", "content": [{"type": "image", "image": img},
                                          {"type": "text", "text": "Describe the image in one sentence."}]}]
    params = _greedy(10)
    first, first_off = on.chat(turn1, params)[0], off.chat(turn1, params)[0]
    assert first.token_ids == first_off.token_ids
    turn2 = turn1 + [{"role": "assistant", "content": first.text},
                     {"role": "user", "content": "And what colour is the shape?"}]
    second, second_off = on.chat(turn2, params)[0], off.chat(turn2, params)[0]
    assert second.token_ids == second_off.token_ids
    # The whole earlier turn, image included, comes from the cache up to a block boundary.
    assert second.num_cached_tokens >= len(first.prompt_token_ids) // 16 * 16 > 0
    assert on.engine.stats()["images_encoded"] == 1
    _assert_clean(on)


def test_eviction_under_memory_pressure(family) -> None:
    on, off = _pair(family, kv_cache_tokens=96, max_num_seqs=2)  # 12 blocks of 8 tokens
    imgs = [_image(10 + i) for i in range(3)]
    texts = ["Describe it.", "What colour is the shape?", "How many triangles?"]
    for round_ in range(3):
        prompts = [_prompt(family, "", imgs[(round_ + i) % 3], texts[i]) for i in range(3)]
        _both(on, off, prompts, _greedy(6))
    stats = on.engine.stats()
    assert stats["kv_evicted_blocks"] > 0 and stats["prefix_cache_hits"] > 0
    _assert_clean(on)


def test_preemption_of_requests_holding_shared_blocks(family) -> None:
    on, off = _pair(family, kv_cache_tokens=128, max_num_batched_tokens=256)  # 16 blocks of 8 tokens
    img = _image(20)
    base = _prompt(family, "", img, "Describe")
    _both(on, off, [base], _greedy(2))  # warms the cache: the next prompts share its image blocks
    prompts = [_prompt(family, "", img, f"Describe {w}") for w in ("it", "the shape", "colours")]
    outs = _both(on, off, prompts, _greedy(40))
    assert all(o.num_cached_tokens > 0 for o in outs)
    assert on.engine.scheduler.num_preemptions_total > 0
    _assert_clean(on)


def test_repeated_image_skips_preprocessing(family) -> None:
    on, off = _pair(family)
    prompt = _prompt(family, "", _image(30, 101, 131), "Describe.")  # a size both processors resize
    a, b = on.engine.process_prompt(prompt), on.engine.process_prompt(prompt)
    assert b.mm_items[0].pixel_values is a.mm_items[0].pixel_values and b.mm_items[0].mm_hash == a.mm_items[0].mm_hash
    assert on.engine.stats()["pixel_cache_hits"] == 1
    c, d = off.engine.process_prompt(prompt), off.engine.process_prompt(prompt)
    assert c.mm_items[0].pixel_values is not d.mm_items[0].pixel_values  # caching off: a cold baseline
    assert (c.mm_items[0].pixel_values == a.mm_items[0].pixel_values).all()


def test_pixel_cache_lru_bounded_in_bytes() -> None:
    import torch

    from flashvlm.processing.pixel_cache import PixelCache

    cache = PixelCache(max_bytes=3 * 400)
    for i in range(4):
        cache.put(f"h{i}", torch.zeros(100), None)  # 400 bytes each
    assert len(cache) == 3 and cache.get("h0") is None and cache.num_bytes == 1200
    assert cache.get("h1") is not None  # h1 becomes the most recent: h2 goes next
    cache.put("h4", torch.zeros(100), None)
    assert cache.get("h2") is None and cache.get("h1") is not None
    cache.put("big", torch.zeros(1000), None)  # larger than the whole budget: not kept
    assert cache.get("big") is None and cache.num_bytes == 1200


@pytest.mark.parametrize("size", [(112, 140), (101, 131)], ids=["no-resize", "resized"])
def test_an_array_is_the_same_picture_as_its_pil_image_and_png(family, size: tuple[int, int]) -> None:
    """An RGB array skips PIL when it needs no resize (Qwen): it must hash, preprocess and count exactly like the
    same pixels given as a PIL image or PNG bytes, so the caches are shared across input forms; and the engine
    keeps its own copy, since the caller may reuse its array."""
    import io

    import torch
    from PIL import Image

    on, _ = _pair(family, enable_prefix_caching=False, encoder_cache_tokens=0)
    on.engine.input_processor.pixel_cache.max_bytes = 0  # every prompt preprocesses afresh
    arr = _image(40, *size)
    png = io.BytesIO()
    Image.fromarray(arr).save(png, format="PNG")
    items = [on.engine.process_prompt(_prompt(family, "", src, "Hi.")).mm_items[0]
             for src in (arr, Image.fromarray(arr), png.getvalue())]
    for other in items[1:]:
        assert other.mm_hash == items[0].mm_hash and other.num_tokens == items[0].num_tokens
        assert other.layout == items[0].layout and other.image_size == items[0].image_size == size
        assert torch.equal(torch.as_tensor(other.pixel_values), torch.as_tensor(items[0].pixel_values))
    before = torch.as_tensor(items[0].pixel_values).clone()
    arr[:] = 0
    assert torch.equal(torch.as_tensor(items[0].pixel_values), before)


def test_pixels_that_took_no_work_are_not_kept(tmp_path) -> None:
    """A Qwen picture that needs no resize is one copy away from its compact pixels: the pixel cache does not hold
    it (holding fresh memory costs more than the copy), while a resized one is kept."""
    path = str(tmp_path)
    build_qwen2_vl(path, seed=5)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=2048, block_size=BS)
    family = ("qwen2_vl", path)
    cache = llm.engine.input_processor.pixel_cache
    llm.engine.process_prompt(_prompt(family, "", _image(31, 112, 140), "Hi."))
    assert len(cache) == 0
    llm.engine.process_prompt(_prompt(family, "", _image(31, 101, 131), "Hi."))
    assert len(cache) == 1
