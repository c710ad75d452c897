"""Rotary embedding of queries and keys in one launch, in place on the packed QKV projection output.

The torch path (`flashvlm.layers.rotary.apply_rotary_reference`) costs five kernels for q and five for k per
layer; under CUDA graphs those small launches, not their bytes, are what a decode step pays for. This kernel
rounds where torch rounds (`x * cos` and `rotate_half(x) * sin` each to the activation dtype, then their sum).
Under Triton's interpreter that is bit-identical to the reference in fp16; compiled on the H200 about a quarter
of the bf16/fp16 elements land one ulp away (measured; the compiled arithmetic differs somewhere we
have not isolated), which the tests bound.

With `qk_norm` (Qwen3's RMSNorm over each query and key head, before the rotary) the same launch normalizes
each head first, rounding as `rms_norm_reference` does, so the unfused path's two reshapes, two norms and the
re-packing copy (six small launches a layer at decode) are gone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.dispatch import next_power_of_2
from flashvlm.layers.rotary import QKNorm, apply_rotary_reference

__all__ = ["apply_rotary_reference", "rotary_qk_inplace"]


@triton.jit
def _rotary_qk_kernel(x_ptr, cos_ptr, sin_ptr, wq_ptr, wk_ptr, stride_xt, stride_ct, stride_st, stride_h, num_heads,
                      num_q_heads, eps, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                      FP32_MATH: tl.constexpr, HAS_NORM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    d_mask = offs < HALF
    mask = (heads[:, None] < num_heads) & d_mask[None, :]
    base = x_ptr + tok * stride_xt + heads[:, None] * stride_h
    ty = x_ptr.dtype.element_ty
    x1 = tl.load(base + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:  # RMSNorm over the whole head (both halves), its weight the query's or the key's
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        is_q = (heads < num_q_heads)[:, None]
        w1 = tl.where(is_q, tl.load(wq_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(wk_ptr + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        w2 = tl.where(is_q, tl.load(wq_ptr + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                      tl.load(wk_ptr + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        # Two roundings, as `weight * h.to(dtype)`: the normalized value, then its product with the weight.
        x1 = (w1 * (x1 * rstd).to(ty).to(tl.float32)).to(ty).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(ty).to(tl.float32)).to(ty).to(tl.float32)
    # cos/sin repeat their first half (emb = cat(freqs, freqs)), but load both halves: a scaled or
    # user-given table need not.
    c1 = tl.load(cos_ptr + tok * stride_ct + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + tok * stride_ct + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + tok * stride_st + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + tok * stride_st + HALF + offs, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    # out = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1); round as the torch path does:
    # in the activation dtype after each product (text decoder), or once at the end (FP32_MATH: vision towers,
    # whose reference upcasts x and takes float32 cos/sin).
    if FP32_MATH:
        lo = x1 * c1 + (-x2 * s1)
        hi = x2 * c2 + x1 * s2
    else:
        lo = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
        hi = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    tl.store(base + offs[None, :], lo.to(ty), mask=mask)
    tl.store(base + HALF + offs[None, :], hi.to(ty), mask=mask)


def rotary_qk_inplace(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int,
                      head_dim: int, fp32_math: bool = False, rotary_dim: int | None = None,
                      qk_norm: QKNorm | None = None) -> None:
    """Rotate the first `num_heads` heads of each row of `qk` in place.

    qk: (tokens, width) with width >= num_heads * head_dim and a contiguous last dim: the packed QKV output,
    whose query and key heads lie side by side at the start of each row (values after them stay untouched).
    cos/sin: (tokens, head_dim) in the activation dtype, as `RotaryEmbedding` returns them.
    fp32_math: compute in float32 and round once (the vision towers' rotary, float32 cos/sin).
    rotary_dim: rotate only the first rotary_dim channels of each head (partial rotary, Persimmon); cos/sin are
    then (tokens, rotary_dim) and the other channels stay untouched.
    qk_norm: RMSNorm each head first (the first qk_norm.num_q_heads heads with the query weight, the rest with the
    key weight, both (head_dim,) in qk's dtype); full rotary only.
    """
    rot = head_dim if rotary_dim is None else rotary_dim
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"the rotated channels must be even and within head_dim {head_dim}, got {rot}")
    if qk.dim() != 2 or qk.stride(1) != 1 or qk.shape[1] < num_heads * head_dim:
        raise ValueError(f"qk must be (tokens, >= {num_heads * head_dim}) with a contiguous last dim")
    tokens = qk.shape[0]
    if cos.shape != (tokens, rot) or sin.shape != (tokens, rot):
        raise ValueError(f"cos/sin must be ({tokens}, {rot}), got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("cos/sin need a contiguous last dim")
    if qk_norm is not None and (rot != head_dim or fp32_math or not qk_norm.fits(qk, head_dim)):
        raise ValueError("qk_norm needs full rotary, the activation dtype's math and (head_dim,) weights in qk's "
                         "dtype")
    if tokens == 0 or num_heads == 0:
        return
    half = rot // 2
    block_d = next_power_of_2(half)
    block_h = min(next_power_of_2(num_heads), max(1, 4096 // block_d))
    grid = (tokens, triton.cdiv(num_heads, block_h))
    wq, wk = (qk_norm.q_weight, qk_norm.k_weight) if qk_norm is not None else (cos, cos)  # unread without a norm
    _rotary_qk_kernel[grid](qk, cos, sin, wq, wk, qk.stride(0), cos.stride(0), sin.stride(0), head_dim, num_heads,
                            qk_norm.num_q_heads if qk_norm is not None else 0,
                            qk_norm.eps if qk_norm is not None else 0.0,
                            HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, FP32_MATH=fp32_math,
                            HAS_NORM=qk_norm is not None, num_warps=4)
