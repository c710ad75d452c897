"""Launcher-side argument checks shared by the paged attention kernels (kv_write, paged_decode, paged_prefill)."""

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


def check_kv_scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the cache is FP8 (e4m3), checking that it then has its two scales: 1-element float32 tensors on the
    cache's device (read by address, so a CUDA graph replays whatever they hold). Other caches take none."""
    if kv_cache.dtype != torch.float8_e4m3fn:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for an FP8 KV cache, not a {kv_cache.dtype} one")
        return False
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.numel() != 1 or scale.dtype != torch.float32 or scale.device != kv_cache.device:
            raise ValueError(f"an FP8 KV cache needs {name} as a 1-element float32 tensor on {kv_cache.device}, "
                             f"got {None if scale is None else (tuple(scale.shape), scale.dtype, scale.device)}")
    return True


def read_context(kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len keys and values stored in `blocks` of the cache, in float32, (seq_len, kv_heads, dim)
    each: an FP8 cache dequantized as x.float() * scale (the references' reading of the cache)."""
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float()
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float()
    if check_kv_scales(kv_cache, k_scale, v_scale):
        k, v = k * k_scale.float(), v * v_scale.float()
    return k, v


def check_key_bias(key_bias: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """A per-slot key bias as the kernels read it: float32, contiguous, one value per cache slot, on the cache's
    device."""
    slots = kv_cache.shape[1] * kv_cache.shape[2]
    if (key_bias.dtype != torch.float32 or key_bias.shape != (slots,) or key_bias.device != kv_cache.device
            or not key_bias.is_contiguous()):
        raise ValueError(f"key_bias must be a contiguous float32 ({slots},) tensor on {kv_cache.device} (one per "
                         f"cache slot), got {key_bias.dtype} {tuple(key_bias.shape)} on {key_bias.device}")
    return key_bias


def context_slots(blocks: torch.Tensor, page: int, seq_len: int) -> torch.Tensor:
    """The cache slots of a sequence's first seq_len tokens, given its blocks (long)."""
    return (blocks[:, None] * page + torch.arange(page, device=blocks.device)[None, :]).flatten()[:seq_len]
