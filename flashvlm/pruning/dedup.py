"""`dedup`: content-adaptive merging of near-duplicate neighbouring tokens, so the kept count follows the picture.

A token whose cosine similarity to its left or its upper neighbour exceeds `threshold` is dropped: merged into
that neighbour, which is either kept or merged the same way further up or left, so every dropped token hangs off
a kept token through a chain of near-duplicate steps. A flat region (a screenshot's blank margin, a plain wall)
collapses to one token per `tile` x `tile` block; a detailed region keeps every token. Merges never cross a tile
border: the tile's top-left token always survives the merging, so a kept token stands for at most tile^2 tokens
(before the cap below) and a slow gradient cannot chain a whole region into one token.

`keep_ratio` is the most it may keep: when more than `kept_count(N, keep_ratio)` tokens survive, the most
distinctive survivors are kept (lowest largest-similarity to their four neighbours; ties to the lower index).
The decision is vectorised over the whole grid; it costs two (N, D) dot products and one argsort, and one host
sync, because the number kept depends on the content."""

from __future__ import annotations

import torch

from flashvlm.pruning.base import PruningStrategy, TokenGrid, kept_count
from flashvlm.pruning.similarity import unit_rows

DEFAULT_THRESHOLD = 0.95
"""Cosine similarity above which neighbours count as duplicates. On the shipped demo model's scenes (at its
168 px training size), of left-neighbour pairs where both 28 px blocks are flat background 82% are above 0.95
(91% above 0.9), of pairs where the block holds an edge 4% (15% above 0.9): 0.95 merges most of a flat region
while rarely merging detail. Lower values merge textures and gradients too (fewer tokens, more accuracy risk);
values near 1 merge only exact repeats."""
DEFAULT_TILE = 4


def neighbour_similarity(embeddings: torch.Tensor, grid: TokenGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, h, w) float32 cosine similarity of each token to its left and to its upper neighbour (-2, below any
    similarity, where there is none)."""
    unit = unit_rows(embeddings).view(grid.t, grid.h, grid.w, -1)
    left = torch.full((grid.t, grid.h, grid.w), -2.0, device=embeddings.device)
    up = torch.full_like(left, -2.0)
    left[:, :, 1:] = (unit[:, :, 1:] * unit[:, :, :-1]).sum(-1)
    up[:, 1:] = (unit[:, 1:] * unit[:, :-1]).sum(-1)
    return left, up


def redundancy(left: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """(t, h, w) largest similarity of each token to its left, upper, right and lower neighbours."""
    right = torch.full_like(left, -2.0)
    down = torch.full_like(up, -2.0)
    right[:, :, :-1] = left[:, :, 1:]
    down[:, :-1] = up[:, 1:]
    return torch.stack([left, up, right, down]).amax(dim=0)


def dedup_survivors(left: torch.Tensor, up: torch.Tensor, threshold: float, tile: int) -> torch.Tensor:
    """(t, h, w) bool: the tokens not merged into a neighbour of their own tile."""
    device = left.device
    inside_tile_left = torch.arange(left.shape[2], device=device) % tile != 0
    inside_tile_up = (torch.arange(left.shape[1], device=device) % tile != 0)[:, None]
    merged = ((left > threshold) & inside_tile_left) | ((up > threshold) & inside_tile_up)
    return ~merged


class DedupStrategy(PruningStrategy):
    name = "dedup"

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, tile: int = DEFAULT_TILE) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not -1.0 <= threshold <= 1.0:
            raise ValueError(f"dedup threshold must be a cosine similarity in [-1, 1], got {threshold!r}")
        if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
            raise ValueError(f"dedup tile must be a positive int (tokens per side), got {tile!r}")
        self.threshold = float(threshold)
        self.tile = tile

    def planned_count(self, num_tokens: int, keep_ratio: float) -> int | None:
        return None

    def _select(self, embeddings: torch.Tensor, grid: TokenGrid, keep_ratio: float) -> torch.Tensor:
        left, up = neighbour_similarity(embeddings, grid)
        survivors = dedup_survivors(left, up, self.threshold, self.tile).flatten()
        similar = redundancy(left, up).flatten()
        # Dropped tokens rank after every survivor; a stable sort keeps ties in raster order.
        score = torch.where(survivors, similar, torch.full_like(similar, float("inf")))
        ranked = torch.argsort(score, stable=True)[:kept_count(grid.num_tokens, keep_ratio)]
        kept = ranked[survivors[ranked]]  # the one host sync: how many survive is known only here
        return torch.sort(kept).values
