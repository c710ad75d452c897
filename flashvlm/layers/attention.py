"""The decoder's attention op: store this step's keys/values in the paged cache, then attend."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashvlm.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class ForwardContext:
    """Everything a forward pass needs beyond its tensors; passed explicitly, never a global."""

    attn_meta: AttentionMetadata
    kv_caches: list[torch.Tensor]
    """One (2, num_blocks, block_size, kv_heads, head_dim) tensor per decoder layer."""
    backend: AttentionBackend


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5 if scale is None else scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: (N, heads*dim), k/v: (N, kv_heads*dim) -> (N, heads*dim)."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        kv_cache = ctx.kv_caches[self.layer_idx]
        ctx.backend.write_kv(k, v, kv_cache, ctx.attn_meta)
        out = ctx.backend.forward(q, kv_cache, ctx.attn_meta, self.scale)
        return out.reshape(n, self.num_heads * self.head_dim)
