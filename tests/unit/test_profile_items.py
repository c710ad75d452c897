"""The stand-in image batch the GPU memory profile runs through the vision tower: the heaviest a step can hold."""

from __future__ import annotations

import math

import pytest

from flashvlm import LLM
from flashvlm.processing.qwen_grid import PATCH_SLACK, largest_qwen_grid, qwen_target_size
from flashvlm.processing.qwen_image import QwenImageProcessor
from flashvlm.request import InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_llava, build_qwen2_vl


def test_qwen_profiles_the_largest_allowed_image(tmp_path) -> None:
    llm = LLM(str(build_qwen2_vl(tmp_path / "q", seed=1)), device="cpu", kv_cache_tokens=2048)
    proc = llm.engine.input_processor.image_processor
    items = llm.engine.input_processor.profile_items(budget_tokens=32)
    assert len(items) == 1  # one max-size image outweighs the whole budget
    t, h, w = items[0].layout
    assert (t, h * w) == (1, 2 * 226)  # max_pixels is 64 windows, but a 15x2993 sliver keeps 1x113 windows
    assert proc.grid_thw(15, 2993) == (1, 2, 226)
    embeddings = llm.engine.runner.model.encode_images(items)
    assert embeddings[0].shape[0] == items[0].num_tokens


def test_fixed_size_towers_profile_a_budget_of_images(tmp_path) -> None:
    llm = LLM(str(build_llava(tmp_path / "l", seed=1)), device="cpu", kv_cache_tokens=2048)
    items = llm.engine.input_processor.profile_items(budget_tokens=100)
    assert len(items) == 100 // items[0].num_tokens
    assert [e.shape[0] for e in llm.engine.runner.model.encode_images(items[:2])] == [items[0].num_tokens] * 2


def _shapes(largest: int) -> list[tuple[int, int]]:
    """(height, width) pairs: a spread of sides up to past the largest image, with the multiples of 28 and their
    neighbours (where smart_resize's rounding flips), and slivers near the 200:1 limit (where it overshoots)."""
    sides = sorted(set(range(1, 64)) | set(range(64, largest, 37))
                   | {k * 28 + d for k in range(1, largest // 28) for d in (-1, 0, 1) if k % 9 == 0})
    slivers = [(h, w) for h in range(1, 41) for w in range(max(h, 200 * h - 300), 200 * h + 1)]
    return [(h, w) for h in sides for w in sides if max(h, w) <= 200 * min(h, w)] + slivers


CONFIGS = [dict(), dict(max_pixels_limit=4 * 28 * 28 * 1280), dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
           dict(min_pixels=3136, max_pixels=3136), dict(min_pixels=28224, max_pixels=28224)]


@pytest.mark.parametrize("config", CONFIGS)
def test_no_accepted_image_has_more_patches_than_the_profile(config) -> None:
    proc = QwenImageProcessor(**config)
    ceiling = max(proc.max_pixels, proc.max_pixels_limit or 0)
    _, gh, gw = largest_qwen_grid(proc)
    overrides = [(None, None), (None, ceiling), (ceiling, ceiling), (proc.min_pixels, proc.min_pixels)]
    side = math.isqrt(ceiling) * 2
    most = {override: 0 for override in overrides}
    refused = 0
    for h, w in _shapes(side):
        for lo, hi in overrides:
            try:
                th, tw = qwen_target_size(proc, h, w, lo, hi)
            except InvalidRequestError:
                assert lo is not None and lo > proc.min_pixels  # only a raised min_pixels is ever refused
                refused += 1
                continue
            most[lo, hi] = max(most[lo, hi], th * tw // proc.patch_size ** 2)
    assert max(most[None, None], most[None, ceiling]) <= gh * gw  # the configured min_pixels: never past it
    assert max(most.values()) <= gh * gw * PATCH_SLACK  # a request's own min_pixels: within the profile's headroom
    assert most[None, None] >= 0.99 * gh * gw or most[None, ceiling] >= 0.99 * gh * gw  # and it is not loose
    assert refused or proc.min_pixels == ceiling  # min = max: nothing to raise min_pixels to


def test_profile_beats_the_square_and_honours_the_request_limit() -> None:
    # The review's cases: 2940x2352 fits 80x64 patches under the default 28*28*1280 (the square gave 70x70), and
    # a raised max_pixels_limit is what the profile must cover, not the configured max_pixels.
    proc = QwenImageProcessor()
    assert proc.grid_thw(2940, 2352) == (1, 80, 64)
    _, gh, gw = largest_qwen_grid(proc)
    assert gh * gw == 80 * 64
    raised = QwenImageProcessor(max_pixels_limit=4 * 28 * 28 * 1280)
    _, h, w = raised.grid_thw(2352, 2940, max_pixels=raised.max_pixels_limit)
    _, gh, gw = largest_qwen_grid(raised)
    assert gh * gw == h * w == 128 * 160


def test_configured_upscale_past_max_pixels_is_profiled_and_a_requested_one_refused() -> None:
    demo = QwenImageProcessor(min_pixels=28224, max_pixels=28224)  # the shipped demo model's settings
    assert demo.grid_thw(1, 197) == (1, 2, 170)  # 85 windows where max_pixels allows 36
    assert largest_qwen_grid(demo)[1:] in ((2, 170), (170, 2))
    proc = QwenImageProcessor()
    assert proc.grid_thw(3, 426, proc.max_pixels, proc.max_pixels)[1:] == (8, 854)  # 6832 patches > 5120
    with pytest.raises(InvalidRequestError, match="lower min_pixels"):
        qwen_target_size(proc, 3, 426, proc.max_pixels, proc.max_pixels)


@pytest.mark.parametrize("width,height", [(640, 480), (800, 600), (1024, 768), (1920, 1080), (480, 640)])
def test_ordinary_photos_grown_to_the_largest_min_pixels_are_served(width: int, height: int) -> None:
    """min_pixels = max_pixels at the limit grows a photo a few percent past the planned grid (both sides round
    up), inside the profile's headroom: served, as before the profile planned for the largest grid."""
    proc = QwenImageProcessor()
    th, tw = qwen_target_size(proc, height, width, proc.max_pixels, proc.max_pixels)
    _, gh, gw = largest_qwen_grid(proc)
    patches = th * tw // proc.patch_size ** 2
    assert patches <= gh * gw * PATCH_SLACK
    if (width, height) == (640, 480):  # the case: past the planned grid (1,302 windows for 1,280), yet served
        assert patches > gh * gw
