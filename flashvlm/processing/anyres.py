"""LLaVA-NeXT's any-resolution geometry, in plain integers: which grid of tiles an image is cut into, how it is fitted
and padded onto that grid, which part of the tiles' feature grid holds the picture (the rest is padding, dropped),
and so how many tokens the image yields. The image processor and the model both read it, so the two can never
disagree on a count.

The rules follow transformers' LlavaNext processor and model (select_best_resolution, the patching resize, unpad):
a candidate resolution wins on the picture area it keeps once fitted (never more than the original), ties broken by
the least wasted canvas, the first candidate winning an exact tie."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple


class AnyResLayout(NamedTuple):
    """One image's `MMItem.layout`: the tile grid its crops come from and the kept box of their feature grid.

    Features of the tiles form a (rows * side) x (cols * side) grid (side: the tower's patches per tile edge);
    rows [row_start, row_stop) and columns [col_start, col_stop) of it hold the picture, each kept row followed by
    the image_newline token. The base image (the whole picture resized to one tile) comes first."""

    rows: int
    cols: int
    side: int
    """Features per tile edge (the tower's image_size // patch_size)."""
    row_start: int
    row_stop: int
    col_start: int
    col_stop: int

    @property
    def num_crops(self) -> int:
        return self.rows * self.cols

    @property
    def num_tokens(self) -> int:
        """Tokens of the image: the base tile's side * side features, then each kept row and its newline."""
        return self.side * self.side + (self.row_stop - self.row_start) * (self.col_stop - self.col_start + 1)


def parse_pinpoints(value: object, tile: int) -> tuple[tuple[int, int], ...]:
    """`image_grid_pinpoints` ([[height, width], ...]) checked: positive multiples of the tile size."""
    if not isinstance(value, Sequence) or isinstance(value, str) or not value:
        raise ValueError(f"image_grid_pinpoints must be a non-empty list of [height, width], got {value!r}")
    out = []
    for pair in value:
        if (not isinstance(pair, Sequence) or len(pair) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in pair)):
            raise ValueError(f"image_grid_pinpoints: {pair!r} is not a [height, width] pair of positive ints")
        if pair[0] % tile or pair[1] % tile:
            raise ValueError(f"image_grid_pinpoints: {list(pair)} is not a multiple of the {tile}-pixel tile")
        out.append((int(pair[0]), int(pair[1])))
    return tuple(out)


def best_resolution(height: int, width: int, pinpoints: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The (height, width) of `pinpoints` that keeps most of the picture when it is fitted into it."""
    best, best_kept, best_waste = pinpoints[0], -1, math.inf
    for ph, pw in pinpoints:
        scale = min(pw / width, ph / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = ph * pw - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (ph, pw), kept, waste
    return best


def fitted_size(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """(height, width) of the picture resized, aspect kept, to fit the target on its tighter side."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def pad_offsets(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """(top, left) of a fitted picture centred on the target canvas (the odd pixel of padding goes after it)."""
    return (target[0] - size[0]) // 2, (target[1] - size[1]) // 2


def layout_for(height: int, width: int, pinpoints: Sequence[tuple[int, int]], tile: int, side: int) -> AnyResLayout:
    """The layout of a `height` x `width` picture: tile grid of its best resolution, and the feature rows or columns
    its padding takes, removed symmetrically (`side` features per tile edge)."""
    best_h, best_w = best_resolution(height, width, pinpoints)
    rows, cols = best_h // tile, best_w // tile
    feat_h, feat_w = rows * side, cols * side
    if width / height > feat_w / feat_h:
        kept = int(round(height * (feat_w / width), 7))
        pad = (feat_h - kept) // 2
        return AnyResLayout(rows, cols, side, pad, feat_h - pad, 0, feat_w)
    kept = int(round(width * (feat_h / height), 7))
    pad = (feat_w - kept) // 2
    return AnyResLayout(rows, cols, side, 0, feat_h, pad, feat_w - pad)


def largest_layout(pinpoints: Sequence[tuple[int, int]], tile: int, side: int) -> AnyResLayout:
    """The layout with the most tokens (then crops) an image can get: a picture of a candidate's own shape loses no
    row or column to padding."""
    return max((layout_for(h, w, pinpoints, tile, side) for h, w in pinpoints),
               key=lambda lay: (lay.num_tokens, lay.num_crops))
