"""`pool`: uniform spatial downsampling of the token grid, the baseline every content-aware strategy must beat.

It is selection, not averaging: it keeps an evenly spread subset of the tokens as they are. Averaging blocks
(true pooling) would create new embeddings at no single token's position, so the kept tokens could not keep
their own (t, h, w) M-RoPE positions and the encoder cache's embeddings could not be spliced unchanged; the
strategy contract (return indices) rules it out. The choice depends only on the grid and the count, never on the
content, so the kept count and positions are known before the vision tower runs."""

from __future__ import annotations

import functools
import math

import torch

from flashvlm.pruning.base import PruningStrategy, TokenGrid, kept_count


def evenly_spaced(length: int, count: int) -> list[int]:
    """`count` distinct indices in [0, length), the midpoints of `count` equal segments (exact integer math)."""
    if not 0 <= count <= length:
        raise ValueError(f"cannot pick {count} of {length}")
    return [((2 * i + 1) * length) // (2 * count) for i in range(count)]


def _lattice(grid: TokenGrid, count: int) -> list[int]:
    """Raster indices of evenly spaced rows x evenly spaced columns in every frame, about `count` in all: each
    axis shrinks by sqrt(count / N), the columns then fitted to the rows so that a thin grid is not starved."""
    per_frame = count / grid.t
    factor = math.sqrt(per_frame / (grid.h * grid.w))
    rows = min(grid.h, max(1, round(grid.h * factor)))
    cols = min(grid.w, max(1, round(per_frame / rows)))
    picked_rows, picked_cols = evenly_spaced(grid.h, rows), evenly_spaced(grid.w, cols)
    return [(f * grid.h + r) * grid.w + c for f in range(grid.t) for r in picked_rows for c in picked_cols]


@functools.lru_cache(maxsize=256)
def pool_indices(grid: TokenGrid, count: int) -> torch.Tensor:
    """The sorted indices `pool` keeps to keep exactly `count` tokens of `grid` (a CPU tensor; do not modify)."""
    lattice = _lattice(grid, count)
    if len(lattice) > count:
        dropped = set(evenly_spaced(len(lattice), len(lattice) - count))
        lattice = [index for position, index in enumerate(lattice) if position not in dropped]
    elif len(lattice) < count:
        taken = set(lattice)
        rest = [index for index in range(grid.num_tokens) if index not in taken]
        lattice = sorted(lattice + [rest[i] for i in evenly_spaced(len(rest), count - len(lattice))])
    return torch.tensor(lattice, dtype=torch.int64)


@functools.lru_cache(maxsize=256)
def _pinned_pool_indices(grid: TokenGrid, count: int) -> torch.Tensor:
    # Copies from pinned memory are asynchronous; from pageable memory the driver may wait for the stream.
    return pool_indices(grid, count).pin_memory()


class PoolStrategy(PruningStrategy):
    """Keeps exactly `kept_count(N, keep_ratio)` tokens spread evenly over the grid. Cost: none on the device
    (the indices are built on the host once per (grid, count) and copied over asynchronously); no host sync."""

    name = "pool"

    def _select(self, embeddings: torch.Tensor, grid: TokenGrid, keep_ratio: float,
                use_kernels: bool) -> torch.Tensor:
        count = kept_count(grid.num_tokens, keep_ratio)
        if embeddings.device.type == "cuda":
            return _pinned_pool_indices(grid, count).to(embeddings.device, non_blocking=True)
        return pool_indices(grid, count).to(embeddings.device, copy=True)
