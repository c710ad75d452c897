"""The largest Qwen image grid a request can produce, which the engine's memory profile plans for, and the check
that refuses a request whose own min_pixels would go past it."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from flashvlm.processing.preprocess import MAX_ASPECT_RATIO
from flashvlm.request import InvalidRequestError

if TYPE_CHECKING:
    from flashvlm.processing.qwen_image import QwenImageProcessor

PATCH_SLACK = 1.1
"""How far past the planned grid a request's own min_pixels may take an image: the profile keeps 10% headroom
(MemoryPlanner.profile_peak_memory), and growing an ordinary photo to min_pixels = max_pixels overshoots by a few
percent (both sides round up: 640x480 gets 1,302 merge windows where 1,280 are planned). Only slivers go further."""


def qwen_target_size(proc: QwenImageProcessor, height: int, width: int, min_pixels: int | None = None,
                     max_pixels: int | None = None) -> tuple[int, int]:
    """proc.target_size, refusing a result with more patches than `largest_qwen_grid`, the image the memory
    profile plans for. Only a request's own min_pixels (its upscale rounds both sides up: a 3x426 image with
    min_pixels = max_pixels = 28*28*1280 gets 1708 merge windows, not 1280) or do_resize off gets there."""
    target = proc.target_size(height, width, min_pixels, max_pixels)
    _, grid_h, grid_w = largest_qwen_grid(proc)
    patches = target[0] * target[1] // proc.patch_size ** 2
    if patches > grid_h * grid_w * PATCH_SLACK:
        raise InvalidRequestError(
            f"image {width}x{height} would be resized to {target[1]}x{target[0]} ({patches} patches), more than the "
            f"{grid_h * grid_w} of the largest image memory was planned for; lower min_pixels or max_pixels")
    return target


def largest_qwen_grid(proc: QwenImageProcessor) -> tuple[int, int, int]:
    """A grid with at least as many patches as any image gets under the configured min_pixels, with max_pixels
    up to the request limit (see `_largest_window_grid`)."""
    ceiling = max(proc.max_pixels, proc.max_pixels_limit or 0)  # the configured max applies even above the limit
    short, long = _largest_window_grid(proc.factor ** 2, proc.min_pixels, ceiling)
    return 1, short * proc.merge_size, long * proc.merge_size


@functools.lru_cache(maxsize=32)
def _largest_window_grid(window_pixels: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(a, b) merge windows with a*b at least that of every smart_resize output, over its three outcomes:
    kept or shrunk within max_pixels (an a x b window image with a*b <= max_pixels / window is kept as it is; the
    best is not the isqrt square: 1280 windows fit 32x40, the best square 35x35 = 1225); shrunk below one window
    on the short side (one is kept there, the long side keeps its share, at most sqrt(200 * max / window));
    grown to min_pixels, where both sides round up (x windows on the short side, just above k, give at most
    (k + 1) * ceil(min / k): the demo's min = max = 36 windows gives a 1x200 image 85)."""
    units = max_pixels // window_pixels
    candidates = [(1, 1)] + [(a, units // a) for a in range(1, math.isqrt(units) + 1)
                             if units // a <= MAX_ASPECT_RATIO * a]
    most = max_pixels / window_pixels
    if most < MAX_ASPECT_RATIO:
        candidates.append((1, math.floor(math.sqrt(MAX_ASPECT_RATIO * most))))
    least = min_pixels / window_pixels
    x_min, x_max = math.sqrt(least / MAX_ASPECT_RATIO), math.sqrt(MAX_ASPECT_RATIO * least)
    candidates += [(k + 1, math.ceil(least / max(k, x_min))) for k in range(math.floor(x_min), math.ceil(x_max))]
    return max(candidates, key=lambda grid: (grid[0] * grid[1], grid[0]))
