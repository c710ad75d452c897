"""`divprune`: max-min diversity selection on the embeddings (the idea of DivPrune, Alvar et al., CVPR 2025).

Pruning is posed as picking the subset whose smallest pairwise distance is largest; the greedy solution keeps
one token, then repeatedly the token farthest (cosine distance, 1 - cos) from everything kept so far. It needs
only the visual embeddings (no attention weights, so it fits FlashAttention) and covers every distinct kind of
content before spending tokens on repeats of one."""

from __future__ import annotations

import torch

from flashvlm.pruning.base import PruningStrategy, TokenGrid, kept_count
from flashvlm.pruning.similarity import unit_rows


def cosine_distances(embeddings: torch.Tensor) -> torch.Tensor:
    """(N, N) float32 cosine distances, clamped to [0, 2] against rounding."""
    unit = unit_rows(embeddings)
    return (1.0 - unit @ unit.T).clamp_(0.0, 2.0)


def max_min_diverse(embeddings: torch.Tensor, count: int) -> torch.Tensor:
    """Greedy max-min selection of `count` rows, in the order picked.

    The seed is the token whose nearest other token is farthest (the most isolated one); each next pick is the
    token with the largest distance to its nearest kept token. Ties go to the lowest index (argmax returns the
    first maximum), so the result is deterministic. A running min-distance vector keeps the cost at one (N, N)
    matmul plus `count` steps of O(N) tensor ops, all on the embeddings' device with no host sync."""
    distances = cosine_distances(embeddings)
    nearest_other = distances.fill_diagonal_(float("inf")).amin(dim=1)
    # A token's distance to itself becomes -1, below any distance: once kept, its running minimum stays -1, so
    # argmax never picks it twice (exact duplicates of kept tokens tie at 0, above it).
    distances.fill_diagonal_(-1.0)
    pick = torch.argmax(nearest_other)
    to_kept = torch.full_like(nearest_other, float("inf"))
    picks = []
    for step in range(count):
        picks.append(pick)
        # index_select, not distances[pick]: a 0-d index tensor would be read on the host.
        to_kept = torch.minimum(to_kept, distances.index_select(0, pick.view(1))[0])
        if step + 1 < count:
            pick = torch.argmax(to_kept)
    return torch.stack(picks)


class DivPruneStrategy(PruningStrategy):
    """Keeps exactly `kept_count(N, keep_ratio)` tokens by greedy max-min diversity. Cost: an (N, N) float32
    distance matrix (29 MB at N = 2,691) and a Python loop of k steps of 3 small kernels each (about 1,700
    launches at N = 2,304, keep 0.25), no host sync; keep 1.0 returns all tokens without computing anything."""

    name = "divprune"

    def _select(self, embeddings: torch.Tensor, grid: TokenGrid, keep_ratio: float) -> torch.Tensor:
        count = kept_count(grid.num_tokens, keep_ratio)
        if count == grid.num_tokens:
            return torch.arange(count, dtype=torch.int64, device=embeddings.device)
        return torch.sort(max_min_diverse(embeddings, count)).values
