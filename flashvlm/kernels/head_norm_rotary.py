"""Per-head LayerNorm and partial rotary of queries and keys in one launch, in place on the packed projection.

Persimmon (Fuyu's decoder) normalizes each query and key head with a LayerNorm of width head_dim (the query
weights for query heads, the key weights for key heads), then rotates the first rotary_dim channels of each head.
The torch path takes two copies out of the packed projection, two LayerNorm launches and two rotary launches a
layer; at decode those small launches are what a step pays for. Here one program per (token, block of heads)
reads each head once (and its rotation partners), normalizes it in float32 with one rounding to the activation
dtype (as F.layer_norm), rotates its first rotary_dim channels rounding where `apply_rotary_reference` rounds, and
writes the whole head back. Reference: `head_norm_rotary_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.dispatch import next_power_of_2
from flashvlm.layers.norm import layer_norm_reference
from flashvlm.layers.rotary import apply_partial_rotary


@triton.jit
def _per_head(q_ptr, k_ptr, idx, is_q, mask):
    """A parameter at channels `idx` of each head: the query's for query heads, the key's for the others."""
    q = tl.load(q_ptr + idx, mask=mask, other=0.0).to(tl.float32)[None, :]
    k = tl.load(k_ptr + idx, mask=mask, other=0.0).to(tl.float32)[None, :]
    return tl.where(is_q, q, k)


@triton.jit
def _head_norm_rotary_kernel(x_ptr, cos_ptr, sin_ptr, wq_ptr, bq_ptr, wk_ptr, bk_ptr, stride_xt, stride_ct,
                             stride_st, num_heads, num_q_heads, eps,
                             HEAD_DIM: tl.constexpr, ROT: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    mask = (heads[:, None] < num_heads) & d_mask[None, :]
    half = ROT // 2
    # Channel d's rotation partner: d + half in the first half of the rotated channels, d - half in the second;
    # the channels past ROT pass through (their partner is themselves, unused).
    partner = tl.where(d < half, d + half, tl.where(d < ROT, d - half, d))
    base = x_ptr + tok * stride_xt + heads[:, None] * HEAD_DIM
    ty = x_ptr.dtype.element_ty
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = (tl.sum(x, axis=1) / HEAD_DIM)[:, None]
    centred = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=1) / HEAD_DIM + eps)[:, None]
    is_q = (heads < num_q_heads)[:, None]
    y = (centred * rstd * _per_head(wq_ptr, wk_ptr, d, is_q, d_mask)
         + _per_head(bq_ptr, bk_ptr, d, is_q, d_mask)).to(ty).to(tl.float32)
    yp = ((xp - mean) * rstd * _per_head(wq_ptr, wk_ptr, partner, is_q, d_mask)
          + _per_head(bq_ptr, bk_ptr, partner, is_q, d_mask)).to(ty).to(tl.float32)
    rotated = d < ROT
    c = tl.load(cos_ptr + tok * stride_ct + d, mask=rotated, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + tok * stride_st + d, mask=rotated, other=0.0).to(tl.float32)[None, :]
    # rotate_half(y) = cat(-y2, y1); each product rounded to the activation dtype, then their sum.
    turned = tl.where((d < half)[None, :], -yp, yp)
    out = (y * c).to(ty).to(tl.float32) + (turned * s).to(ty).to(tl.float32)
    out = tl.where(rotated[None, :], out, y)
    tl.store(base + d[None, :], out.to(ty), mask=mask)


def head_norm_rotary_inplace(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                             num_k_heads: int, head_dim: int, q_norm: tuple[torch.Tensor, torch.Tensor],
                             k_norm: tuple[torch.Tensor, torch.Tensor], eps: float) -> None:
    """LayerNorm each of the first num_q_heads + num_k_heads heads of each row of `qk` with its (weight, bias)
    (q_norm for the query heads, k_norm for the key heads, each (head_dim,) in qk's dtype), then rotate the first
    cos.shape[1] channels of each, in place.

    qk: (tokens, width) with width >= (num_q_heads + num_k_heads) * head_dim and a contiguous last dim: the packed
    projection, queries then keys at the start of each row (values after them stay untouched).
    cos/sin: (tokens, rotary_dim), rotary_dim even and at most head_dim, contiguous last dim."""
    tokens, rot = qk.shape[0], cos.shape[-1]
    num_heads = num_q_heads + num_k_heads
    if rot % 2 or not 0 < rot <= head_dim or cos.shape != (tokens, rot) or sin.shape != (tokens, rot):
        raise ValueError(f"cos/sin must be ({tokens}, an even rotary_dim <= {head_dim}), got {tuple(cos.shape)}")
    if qk.dim() != 2 or qk.stride(1) != 1 or qk.shape[1] < num_heads * head_dim:
        raise ValueError(f"qk must be (tokens, >= {num_heads * head_dim}) with a contiguous last dim")
    params = (*q_norm, *k_norm)
    if any(p.shape != (head_dim,) or p.dtype != qk.dtype or not p.is_contiguous() for p in params):
        raise ValueError(f"the norms' weights and biases must be ({head_dim},) contiguous, in {qk.dtype}")
    if cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError("cos/sin need a contiguous last dim")
    if tokens == 0 or num_heads == 0:
        return
    block_d = next_power_of_2(head_dim)
    block_h = min(next_power_of_2(num_heads), max(1, 2048 // block_d))
    grid = (tokens, triton.cdiv(num_heads, block_h))
    _head_norm_rotary_kernel[grid](qk, cos, sin, *params, qk.stride(0), cos.stride(0), sin.stride(0), num_heads,
                                   num_q_heads, eps, HEAD_DIM=head_dim, ROT=rot, BLOCK_H=block_h, BLOCK_D=block_d,
                                   num_warps=4)


def head_norm_rotary_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                               head_dim: int, q_norm: tuple[torch.Tensor, torch.Tensor],
                               k_norm: tuple[torch.Tensor, torch.Tensor], eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path: (tokens, heads * head_dim) q and k, each head LayerNorm-ed then partially rotated."""
    n = q.shape[0]

    def one(x: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        normed = layer_norm_reference(x.reshape(-1, head_dim), None, *norm, eps).view(n, -1, head_dim)
        return apply_partial_rotary(normed, cos, sin).reshape(n, -1)

    return one(q, q_norm), one(k, k_norm)
