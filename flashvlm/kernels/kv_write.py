"""Scatter this step's keys and values into the paged KV cache by slot mapping.

Algorithm: token t of the flat batch goes to cache slot s = slot_mapping[t], i.e. page s // block_size,
row s % block_size; all KV heads and the whole head_dim of that token are copied at once, cast to the
cache dtype. Slots < 0 mark padding rows (CUDA-graph batches padded to a captured size) and are skipped.
Grid: (N,), one program per token; each moves kv_heads * head_dim elements of K and of V.
Limits: the last dim of k, v and the cache must be contiguous; the token and head strides of k and v are
free (they may be views into a packed QKV output). Device tensors only, so the launch is graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # The slot is loaded once per head row (same address, so one transaction): a per-row vector rather than a
    # scalar, because the interpreter mis-types masks built from a broadcast scalar comparison.
    slot = tl.load(slot_ptr + tok + offs_h * 0).to(tl.int64)[:, None]
    mask = (slot >= 0) & (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v: (N, kv_heads, head_dim); kv_cache: (2, num_blocks, block_size, kv_heads, head_dim); slots (N,)."""
    n, kv_heads, head_dim = k.shape
    if n == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_dim")
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    block_h = triton.next_power_of_2(kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _kv_write_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, PAGE=kv_cache.shape[2],
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain-torch version of kv_write, including the skip of negative (padding) slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    key_cache = kv_cache[0].view(-1, *kv_cache.shape[-2:])
    value_cache = kv_cache[1].view(-1, *kv_cache.shape[-2:])
    key_cache.index_copy_(0, slots, k[keep].to(kv_cache.dtype))
    value_cache.index_copy_(0, slots, v[keep].to(kv_cache.dtype))
