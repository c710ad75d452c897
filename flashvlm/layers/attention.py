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
    kv_amax: torch.Tensor | None = None
    """(num_layers, 2) float32, or None: when set (the start-up calibration of an FP8 cache's scales), each layer
    raises its row to the largest |K| and |V| it wrote."""


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 scale: float | None = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not divisible by num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = head_dim**-0.5 if scale is None else scale
        # An FP8 KV cache stores K / k_scale and V / v_scale (attention/kv_quant.py). NaN until the checkpoint's
        # kv_cache_scheme or the runner's calibration sets them, so a cache read with a scale nobody set gives NaN,
        # never a silent 1.0; caches in the model's dtype never read them. Tensors, not floats: CUDA graphs read
        # them by address. Not in the state dict: a checkpoint without them is complete.
        self.register_buffer("k_scale", torch.full((1,), float("nan"), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.full((1,), float("nan"), dtype=torch.float32), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """q: (N, heads*dim), k/v: (N, kv_heads*dim) -> (N, heads*dim)."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        kv_cache = ctx.kv_caches[self.layer_idx]
        if ctx.kv_amax is not None:
            seen = torch.stack([k.detach().abs().amax(), v.detach().abs().amax()]).float()
            torch.maximum(ctx.kv_amax[self.layer_idx], seen, out=ctx.kv_amax[self.layer_idx])
        ctx.backend.write_kv(k, v, kv_cache, ctx.attn_meta, self.k_scale, self.v_scale)
        out = ctx.backend.forward(q, kv_cache, ctx.attn_meta, self.scale, self.k_scale, self.v_scale)
        return out.reshape(n, self.num_heads * self.head_dim)
