"""Scatter this step's keys and values into the paged KV cache by slot mapping.

Algorithm: token t of the flat batch goes to cache slot s = slot_mapping[t], i.e. page s // block_size,
row s % block_size; all KV heads and the whole head_dim of that token are copied at once, cast to the
cache dtype. Slots < 0 mark padding rows (CUDA-graph batches padded to a captured size) and are skipped.
An FP8 (e4m3) cache stores k / k_scale and v / v_scale (the layer's scales, 1-element float32 tensors), divided
in float32 with round-to-nearest, saturated to +-448 and rounded to nearest even: bit for bit what
attention/kv_quant.quantize_kv computes. The FP8 steps sit behind a constexpr, so a cache in the model's dtype
compiles no FP8 code.
Grid: (N,), one program per token; each moves kv_heads * head_dim elements of K and of V.
Limits: the last dim of k, v and the cache must be contiguous; the token and head strides of k and v are
free (they may be views into a packed QKV output). Device tensors only, so the launch is graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.attention.kv_quant import quantize_kv, scatter_into
from flashvlm.kernels.paged_args import check_kv_scales

FP8_MAX = tl.constexpr(448.0)
"""The largest finite e4m3 value (torch.finfo(torch.float8_e4m3fn).max)."""
FP8_MIN_NORMAL = tl.constexpr(2.0**-6)
SUBNORMAL_ROUNDER = tl.constexpr(1.5 * 2.0**14)
"""A float32 whose unit in the last place is 2^-9, e4m3's subnormal step: (a + it) - it rounds a to that step."""


@triton.jit
def _quantize_e4m3(x, scale):
    """x / scale, saturated to the finite e4m3 range and rounded to nearest even e4m3 value, in float32: the cast
    that follows is then exact. Rounding here rather than in the cast because Triton's interpreter rounds e4m3 casts
    wrongly across a power of two (125.8 -> 64); on the GPU the result is the same bytes as the hardware cast."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    # Normal range: keep 3 of float32's 23 mantissa bits, ties to even (a carry moves into the exponent).
    bits = y.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # Below 2^-6 the step is a fixed 2^-9; the sign bit is put back, so a negative value rounding to 0 stays -0.
    a = tl.abs(y)
    small = ((a + SUBNORMAL_ROUNDER) - SUBNORMAL_ROUNDER).to(tl.uint32, bitcast=True) | (bits & 0x80000000)
    return tl.where(a >= FP8_MIN_NORMAL, normal, small.to(tl.float32, bitcast=True))


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, KV_FP8: tl.constexpr,
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
    if KV_FP8:
        k = _quantize_e4m3(k, tl.load(k_scale_ptr))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:
        v = _quantize_e4m3(v, tl.load(v_scale_ptr))
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """k, v: (N, kv_heads, head_dim); kv_cache: (2, num_blocks, block_size, kv_heads, head_dim); slots (N,).
    An FP8 cache needs k_scale and v_scale (1-element float32 tensors); other caches take none."""
    n, kv_heads, head_dim = k.shape
    kv_fp8 = check_kv_scales(kv_cache, k_scale, v_scale)
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
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, PAGE=kv_cache.shape[2],
        KV_FP8=kv_fp8,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Plain-torch version of kv_write, including the skip of negative (padding) slots."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k, v = k[keep], v[keep]
    if check_kv_scales(kv_cache, k_scale, v_scale):
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    scatter_into(kv_cache[0].view(-1, *kv_cache.shape[-2:]), slots, k.to(kv_cache.dtype))
    scatter_into(kv_cache[1].view(-1, *kv_cache.shape[-2:]), slots, v.to(kv_cache.dtype))
