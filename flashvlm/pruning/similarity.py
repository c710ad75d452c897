"""Cosine similarity between token embeddings, in float32 whatever the embeddings' dtype (bf16 dot products
over thousands of channels round too coarsely to rank near-duplicates)."""

from __future__ import annotations

import torch


def unit_rows(embeddings: torch.Tensor) -> torch.Tensor:
    """The rows of `embeddings` in float32, scaled to unit length (an all-zero row stays zero)."""
    rows = embeddings.float()
    return rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)
