"""`dedup`: content-adaptive merging of near-duplicate neighbouring tokens, decided from the pixels each merged
token covers, so the kept count follows the picture and is known before the vision tower runs.

Each merged token covers one block of the preprocessed image (Qwen-VL: 28 x 28 px, merge x merge patches; CLIP:
one 14 x 14 px patch). A token is merged into its left or its upper neighbour when the two blocks are equal within
`threshold` intensity levels at every pixel and channel (largest absolute difference <= threshold, on the 0-255
scale of the resized image); the neighbour is either kept or merged the same way further up or left, so every
dropped token hangs off a kept token through a chain of near-equal steps. A flat region (a screenshot's blank
margin, a plain background) collapses to one token per `tile` x `tile` block of tokens; a block holding anything
that differs from its neighbours by more than the threshold (an edge, a glyph, texture, sensor noise) is kept.
Merges never cross a tile border: a tile's top-left token always survives, so a kept token stands for at most
tile^2 tokens and a slow gradient cannot chain a whole region into one token.

`keep_ratio` is the most it may keep: when more than `kept_count(N, keep_ratio)` tokens survive, the most
distinctive survivors are kept (largest mean absolute difference to their most similar neighbour; ties to the
lower index). Pixels, not embeddings: the decision is made when the prompt's placeholders are expanded, and the
tower still runs on the whole image, so its full embeddings serve every setting from the encoder cache."""

from __future__ import annotations

import math

import torch

from flashvlm.pruning.base import PixelPruningStrategy, TokenGrid, kept_count
from flashvlm.pruning.setting import DEFAULT_DEDUP_THRESHOLD, DEFAULT_DEDUP_TILE, validate_dedup_threshold

_NO_NEIGHBOUR = 256
"""A difference above any two uint8 blocks': where a token has no left (upper) neighbour."""


def _differences(blocks: torch.Tensor, grid: TokenGrid, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, h, w) largest (int32) or mean (float32) absolute difference of each token's block to its left and to
    its upper neighbour's; 256, above any, where there is none. The mean is exact: sums of at most 2^24 levels."""
    b = blocks.view(grid.t, grid.h, grid.w, -1)
    shape = (grid.t, grid.h, grid.w)
    dtype = torch.int32 if largest else torch.float32
    left = torch.full(shape, _NO_NEIGHBOUR, dtype=dtype, device=blocks.device)
    up = torch.full_like(left, _NO_NEIGHBOUR)
    for out, this, other in ((left[:, :, 1:], b[:, :, 1:], b[:, :, :-1]), (up[:, 1:], b[:, 1:], b[:, :-1])):
        if out.numel():
            diff = torch.maximum(this, other).sub_(torch.minimum(this, other))  # |a - b| in uint8, no widening
            out.copy_(diff.amax(dim=-1) if largest else diff.float().mean(dim=-1))
    return left, up


def dedup_survivors(left_max: torch.Tensor, up_max: torch.Tensor, threshold: float, tile: int) -> torch.Tensor:
    """(t, h, w) bool: the tokens not merged into a near-equal neighbour of their own tile."""
    device = left_max.device
    inside_tile_left = torch.arange(left_max.shape[2], device=device) % tile != 0
    inside_tile_up = (torch.arange(left_max.shape[1], device=device) % tile != 0)[:, None]
    merged = ((left_max <= threshold) & inside_tile_left) | ((up_max <= threshold) & inside_tile_up)
    return ~merged


def distinctiveness(left_mean: torch.Tensor, up_mean: torch.Tensor) -> torch.Tensor:
    """(t, h, w) mean absolute difference of each token's block to its most similar of its four neighbours'."""
    right = torch.full_like(left_mean, float(_NO_NEIGHBOUR))
    down = torch.full_like(up_mean, float(_NO_NEIGHBOUR))
    right[:, :, :-1] = left_mean[:, :, 1:]
    down[:, :-1] = up_mean[:, 1:]
    return torch.stack([left_mean, up_mean, right, down]).amin(dim=0)


class DedupStrategy(PixelPruningStrategy):
    name = "dedup"

    def __init__(self, threshold: float = DEFAULT_DEDUP_THRESHOLD, tile: int = DEFAULT_DEDUP_TILE) -> None:
        self.threshold = validate_dedup_threshold(threshold)
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"dedup tile must be a positive int (tokens per side), got {tile!r}")
        self.tile = tile

    def fewest_kept(self, grid: TokenGrid, keep_ratio: float) -> int:
        # A tile's top-left token always survives the merging.
        tiles = grid.t * math.ceil(grid.h / self.tile) * math.ceil(grid.w / self.tile)
        return min(tiles, kept_count(grid.num_tokens, keep_ratio))

    def _select_pixels(self, blocks: torch.Tensor, grid: TokenGrid, keep_ratio: float) -> torch.Tensor:
        survivors = dedup_survivors(*_differences(blocks, grid, largest=True), self.threshold, self.tile)
        kept = survivors.flatten().nonzero().flatten()
        cap = kept_count(grid.num_tokens, keep_ratio)
        if kept.numel() <= cap:
            return kept
        score = distinctiveness(*_differences(blocks, grid, largest=False)).flatten()[kept]
        # A stable sort keeps equally distinctive tokens in raster order.
        ranked = torch.argsort(score, descending=True, stable=True)[:cap]
        return torch.sort(kept[ranked]).values
