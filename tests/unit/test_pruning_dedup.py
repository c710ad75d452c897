"""`dedup` as a pure function of the pixels each merged token covers: a screenshot's wide flat margins collapse
(at most 30% kept at the default threshold) while every token holding detail stays, a noisy picture keeps every
token up to the cap, what the threshold means in intensity levels, the tiles, and the families' per-token pixels
(Qwen's compact and model-ready paths agree; CLIP's)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashvlm.processing.clip_image import ClipImageInputs, ClipImageProcessor
from flashvlm.processing.preprocess import normalize, pixel_levels, token_blocks
from flashvlm.processing.qwen_image import QwenImageInputs, QwenImageProcessor
from flashvlm.pruning.base import TokenGrid, kept_count
from flashvlm.pruning.dedup import DedupStrategy
from flashvlm.pruning.setting import DEFAULT_DEDUP_THRESHOLD, DEFAULT_DEDUP_TILE
from flashvlm.request import MMItem

BLOCK = 28  # Qwen-VL: a merged token covers 2 x 2 patches of 14 px
BACKGROUND = (246, 246, 244)


def screenshot(rows: int, cols: int, window: tuple[slice, slice], seed: int) -> np.ndarray:
    """A rows x cols token (28 px) picture: a flat margin around a white window of black text-like strokes (each
    token of the window gets its own random glyph pixels, so no two of its blocks are equal)."""
    rng = np.random.default_rng(seed)
    image = np.empty((rows * BLOCK, cols * BLOCK, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    r, c = window
    text = np.full(((r.stop - r.start) * BLOCK, (c.stop - c.start) * BLOCK, 3), 255, dtype=np.uint8)
    ink = rng.random(text.shape[:2]) < 0.15
    text[ink] = 0
    image[r.start * BLOCK:r.stop * BLOCK, c.start * BLOCK:c.stop * BLOCK] = text
    return image


def select(image: np.ndarray, ratio: float = 1.0, **params) -> torch.Tensor:
    rows, cols = image.shape[0] // BLOCK, image.shape[1] // BLOCK
    blocks = token_blocks(torch.from_numpy(image), BLOCK)
    return DedupStrategy(**params).select_pixels(blocks, TokenGrid(1, rows, cols), ratio)


def _window_tokens(cols: int, window: tuple[slice, slice]) -> set[int]:
    r, c = window
    return {row * cols + col for row in range(r.start, r.stop) for col in range(c.start, c.stop)}


def test_defaults() -> None:
    assert DEFAULT_DEDUP_THRESHOLD == 8.0 and DEFAULT_DEDUP_TILE == 4
    strategy = DedupStrategy()
    assert (strategy.threshold, strategy.tile) == (8.0, 4)


def test_screenshot_with_wide_margins_keeps_few_tokens_and_all_its_text() -> None:
    rows, cols, window = 24, 32, (slice(6, 15), slice(8, 22))  # 126 of 768 tokens hold text
    kept = select(screenshot(rows, cols, window, seed=1))
    assert kept.numel() <= 0.30 * rows * cols
    text = _window_tokens(cols, window)
    assert text <= set(kept.tolist()), "a token holding text was merged"
    # The margin collapses to at most one token per 4 x 4 tile.
    assert kept.numel() - len(text) <= math.ceil(rows / 4) * math.ceil(cols / 4)
    assert DedupStrategy().fewest_kept(TokenGrid(1, rows, cols), 1.0) == 6 * 8


def test_noisy_picture_keeps_every_token_up_to_the_cap() -> None:
    noisy = np.random.default_rng(2).integers(0, 256, (16 * BLOCK, 20 * BLOCK, 3), dtype=np.uint8)
    for ratio in (1.0, 0.5, 0.25, 0.11):
        assert select(noisy, ratio).numel() == kept_count(320, ratio)
    assert torch.equal(select(noisy), torch.arange(320))


def test_cap_keeps_the_most_distinctive() -> None:
    rows, cols, window = 24, 32, (slice(6, 15), slice(8, 22))
    image = screenshot(rows, cols, window, seed=3)
    ratio = 100 / (rows * cols)  # fewer than the 126 text tokens may stay
    kept = select(image, ratio)
    assert kept.numel() == kept_count(rows * cols, ratio)
    assert set(kept.tolist()) <= _window_tokens(cols, window), "margin kept over text"
    assert torch.equal(kept, select(image.copy(), ratio)), "deterministic"


def _flat_with_noise(amplitude: int, seed: int, rows: int = 8, cols: int = 8) -> np.ndarray:
    """A flat picture plus independent uniform noise in [0, amplitude] levels at every pixel and channel: two
    blocks then differ by at most `amplitude` (and nearly that much somewhere)."""
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, amplitude + 1, (rows * BLOCK, cols * BLOCK, 3))
    return (100 + noise).astype(np.uint8)


def test_threshold_is_the_largest_pixel_difference_merged() -> None:
    tiles = 4  # an 8 x 8 token picture has 2 x 2 tiles
    assert select(_flat_with_noise(0, 1), threshold=0).numel() == tiles  # exact repeats merge even at 0
    faint = _flat_with_noise(6, 2)  # JPEG-like ripple on a flat colour
    assert select(faint).numel() == tiles  # at the default 8
    assert select(faint, threshold=5).numel() == 64
    strong = _flat_with_noise(40, 3)  # sensor noise of a photo, a texture
    assert select(strong).numel() == 64 and select(strong, threshold=40).numel() == tiles
    # One pixel of one channel off by more than the threshold keeps the token.
    image = _flat_with_noise(0, 4)
    image[3 * BLOCK + 5, 5 * BLOCK + 7, 2] += 9
    assert 3 * 8 + 5 in select(image).tolist() and select(image, threshold=9).numel() == tiles


def test_tiles_stop_a_gradient_chaining_into_one_token() -> None:
    # Each token column is 2 levels brighter than the one to its left: every neighbour pair is near-equal at the
    # default threshold, the row's ends 62 levels apart.
    image = np.repeat((np.arange(32) * 2 + 50).astype(np.uint8), BLOCK)[None, :, None].repeat(8 * BLOCK, 0)
    image = image.repeat(3, axis=2)
    assert select(image).numel() == 2 * 8
    assert torch.equal(select(image, tile=1), torch.arange(8 * 32))


@pytest.mark.parametrize("grid", [TokenGrid(1, 1, 1), TokenGrid(1, 1, 9), TokenGrid(2, 5, 6), TokenGrid(1, 13, 7)],
                         ids=str)
def test_contract(grid: TokenGrid) -> None:
    gen = torch.Generator().manual_seed(grid.num_tokens)
    flat = torch.full((grid.num_tokens, 12), 7, dtype=torch.uint8)
    for blocks in (flat, torch.randint(0, 256, (grid.num_tokens, 12), dtype=torch.uint8, generator=gen)):
        for ratio in (1.0, 0.5, 0.11, 0.01):
            kept = DedupStrategy().select_pixels(blocks, grid, ratio)
            values = kept.tolist()
            assert kept.dtype == torch.int64 and values == sorted(set(values)) and values[0] >= 0
            assert values[-1] < grid.num_tokens
            fewest = DedupStrategy().fewest_kept(grid, ratio)
            assert fewest <= len(values) <= kept_count(grid.num_tokens, ratio)
            if blocks is flat:
                assert len(values) == fewest  # one token a tile (per frame), or the cap


def test_pixel_levels_undo_normalize_exactly() -> None:
    levels = np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1)[None]  # (1, 256, 3)
    for proc in (QwenImageProcessor(), ClipImageProcessor(), QwenImageProcessor(do_normalize=False),
                 QwenImageProcessor(do_rescale=False, do_normalize=False)):
        floats = normalize(levels, proc, None)
        assert torch.equal(pixel_levels(floats, proc, channel_dim=2), torch.from_numpy(levels))
    # The item's pixels (maybe the pixel cache's) are read, never written, even where nothing is undone.
    raw = torch.tensor([[[1.4, 2.6, 300.0]]])
    levels = pixel_levels(raw, QwenImageProcessor(do_rescale=False, do_normalize=False), channel_dim=2)
    assert levels.tolist() == [[[1, 3, 255]]] and raw.tolist() == [[[1.399999976158142, 2.5999999046325684, 300.0]]]


def test_qwen_compact_and_model_ready_pixels_choose_the_same_tokens() -> None:
    inputs = QwenImageInputs(QwenImageProcessor())
    image = screenshot(8, 10, (slice(2, 5), slice(3, 8)), seed=5)
    image[0:BLOCK, 0:6] = 0  # a mark in the margin, away from its neighbours
    compact = torch.from_numpy(image.copy())
    grid = (1, 16, 20)
    items = [MMItem("a", compact, num_tokens=80, layout=grid),
             MMItem("a", inputs.processor.decode_compact(compact), num_tokens=80, layout=grid)]
    token_grid = inputs.token_grid(items[0])
    chosen = []
    for item in items:
        blocks = inputs.token_pixels(item)
        assert blocks.dtype == torch.uint8 and blocks.shape[0] == token_grid.num_tokens == 80
        chosen.append(DedupStrategy().select_pixels(blocks, token_grid, 1.0))
    assert torch.equal(chosen[0], chosen[1])
    assert 0 in chosen[0].tolist() and _window_tokens(10, (slice(2, 5), slice(3, 8))) <= set(chosen[0].tolist())
    assert chosen[0].numel() < 80


def test_clip_pixels_are_its_patches() -> None:
    inputs = ClipImageInputs(ClipImageProcessor(), patch_size=14)
    image = np.full((336, 336, 3), 128, dtype=np.uint8)
    image[:28, :42] = np.random.default_rng(6).integers(0, 256, (28, 42, 3))  # 2 x 3 patches of detail
    item = MMItem("c", normalize(image, inputs.processor, None).permute(2, 0, 1).contiguous(), num_tokens=576)
    grid = inputs.token_grid(item)
    blocks = inputs.token_pixels(item)
    assert grid == TokenGrid(1, 24, 24) and blocks.shape == (576, 14 * 14 * 3)
    kept = set(DedupStrategy().select_pixels(blocks, grid, 1.0).tolist())
    detail = {0, 1, 2, 24, 25, 26}
    tile_starts = {row * 24 + col for row in range(0, 24, 4) for col in range(0, 24, 4)}
    # Besides the detail and a token a tile, only flat tokens next to the detail (their merge target differs).
    assert detail <= kept and kept - detail - tile_starts <= {3, 27, 48, 49, 50}
    assert len(kept) < 50


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_agrees_with_cpu() -> None:
    image = screenshot(24, 32, (slice(6, 15), slice(8, 22)), seed=7)
    blocks = token_blocks(torch.from_numpy(image), BLOCK)
    grid = TokenGrid(1, 24, 32)
    for ratio in (1.0, 0.1):
        on_device = DedupStrategy().select_pixels(blocks.cuda(), grid, ratio)
        assert on_device.device.type == "cuda"
        assert torch.equal(on_device.cpu(), DedupStrategy().select_pixels(blocks, grid, ratio))
