"""`divprune`: max-min diversity selection on the embeddings (the idea of DivPrune, Alvar et al., CVPR 2025).

Pruning is posed as picking the subset whose smallest pairwise distance is largest; the greedy solution keeps
one token, then repeatedly the token farthest (cosine distance, 1 - cos) from everything kept so far. It needs
only the visual embeddings (no attention weights, so it fits FlashAttention) and covers every distinct kind of
content before spending tokens on repeats of one."""

from __future__ import annotations

import torch

from flashvlm.kernels.dispatch import use_triton
from flashvlm.kernels.max_min_torch import max_min_select_reference
from flashvlm.pruning.base import PruningStrategy, TokenGrid, kept_count
from flashvlm.pruning.similarity import unit_rows


def cosine_distances(embeddings: torch.Tensor) -> torch.Tensor:
    """(N, N) float32 cosine distances, clamped to [0, 2] against rounding."""
    unit = unit_rows(embeddings)
    return (1.0 - unit @ unit.T).clamp_(0.0, 2.0)


def max_min_diverse(embeddings: torch.Tensor, count: int, use_kernels: bool = True) -> torch.Tensor:
    """Greedy max-min selection of `count` rows, in the order picked.

    The seed is the token whose nearest other token is farthest (the most isolated one); each next pick is the
    token with the largest distance to its nearest kept token. Ties go to the lowest index, so the result is
    deterministic. One (N, N) matmul, then the picks: one Triton launch on a GPU (kernels/max_min_select.py),
    else `count` steps of three small torch ops; no host sync either way."""
    distances = cosine_distances(embeddings)
    nearest_other = distances.fill_diagonal_(float("inf")).amin(dim=1)
    # A token's distance to itself becomes -1, below any distance: once kept, its running minimum stays -1, so
    # it is never picked twice (exact duplicates of kept tokens tie at 0, above it).
    distances.fill_diagonal_(-1.0)
    seed = torch.argmax(nearest_other).view(1)
    if use_triton(distances, use_kernels):
        from flashvlm.kernels.max_min_select import max_min_select_triton

        return max_min_select_triton(distances, seed, count)
    return max_min_select_reference(distances, seed, count)


class DivPruneStrategy(PruningStrategy):
    """Keeps exactly `kept_count(N, keep_ratio)` tokens by greedy max-min diversity. Cost: an (N, N) float32
    distance matrix (29 MB at N = 2,691) and the picks (one kernel on a GPU; on the CPU k steps of 3 small ops),
    no host sync; keep 1.0 returns all tokens without computing anything."""

    name = "divprune"

    def _select(self, embeddings: torch.Tensor, grid: TokenGrid, keep_ratio: float,
                use_kernels: bool) -> torch.Tensor:
        count = kept_count(grid.num_tokens, keep_ratio)
        if count == grid.num_tokens:
            return torch.arange(count, dtype=torch.int64, device=embeddings.device)
        return torch.sort(max_min_diverse(embeddings, count, use_kernels)).values
