"""`none`: every token is kept, whatever the keep ratio."""

from __future__ import annotations

import torch

from flashvlm.pruning.base import PruningStrategy, TokenGrid


class KeepAllStrategy(PruningStrategy):
    name = "none"

    def planned_count(self, num_tokens: int, keep_ratio: float) -> int:
        return num_tokens

    def _select(self, embeddings: torch.Tensor, grid: TokenGrid, keep_ratio: float,
                use_kernels: bool) -> torch.Tensor:
        return torch.arange(grid.num_tokens, dtype=torch.int64, device=embeddings.device)
