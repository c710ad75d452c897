"""Launcher-side argument checks shared by the paged attention kernels (paged_decode, paged_prefill)."""

from __future__ import annotations

import torch


def gqa_group(num_heads: int, kv_heads: int) -> int:
    """Query heads per KV head; the kernels serve one whole group per program, so it must divide evenly."""
    if num_heads % kv_heads:
        raise ValueError(f"num_heads {num_heads} not divisible by kv_heads {kv_heads}")
    return num_heads // kv_heads


def last_dim_contiguous(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                        block_tables: torch.Tensor) -> torch.Tensor:
    """q with a unit stride in its last dim, copied if it has none (the kernels address that dim by offset
    alone). The cache, out and block_tables are read or written in place, so they must have one already."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_cache.stride(-1) != 1 or out.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("kv_cache, out and block_tables must be contiguous in their last dim")
    return q
