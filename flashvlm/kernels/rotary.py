"""Rotary position embedding (rotate-half layout), 1-D RoPE and Qwen2-VL M-RoPE, one program per token.

`apply_rotary_triton` takes precomputed cos/sin rows: the drop-in for `layers.rotary.apply_rotary`. (Computing
cos/sin inside the kernel was tried and dropped: Triton's tl.cos/tl.sin are approximate for large angles, so bf16
results drifted from the torch path on the GPU.)

Numerics follow the torch path op by op (`x * cos + rotate_half(x) * sin` in the output dtype): each product
is rounded to the output dtype, then the sum is. Products of two bf16/fp16 values are exact in fp32, so the
results match torch bit for bit whenever cos/sin match. References: `layers.rotary.rotary_cos_sin` and
`layers.rotary.apply_rotary_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.dispatch import next_power_of_2

__all__ = ["apply_rotary_triton"]


@triton.jit
def _rotate_heads(x_ptr, o_ptr, x_stride_t, x_stride_h, o_stride_t, o_stride_h, tok, n_heads,
                  c1, s1, c2, s2, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < HALF)
    src = x_ptr + tok * x_stride_t + h * x_stride_h + d
    # Both halves are loaded before either is stored, so in-place (o_ptr == x_ptr) is safe.
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = o_ptr.dtype.element_ty
    a1 = (x1 * c1[None, :]).to(ty).to(tl.float32)
    b1 = (x2 * s1[None, :]).to(ty).to(tl.float32)
    a2 = (x2 * c2[None, :]).to(ty).to(tl.float32)
    b2 = (x1 * s2[None, :]).to(ty).to(tl.float32)
    dst = o_ptr + tok * o_stride_t + h * o_stride_h + d
    tl.store(dst, (a1 - b1).to(ty), mask=mask)
    tl.store(dst + HALF, (a2 + b2).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, qo_ptr, cos_ptr, sin_ptr, q_stride_t, q_stride_h, qo_stride_t, qo_stride_h,
                   cos_stride_t, sin_stride_t, n_q_heads,
                   HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    # Tables may hold different halves in general; load both rather than assume cat(freqs, freqs).
    c1 = tl.load(cos_ptr + tok * cos_stride_t + d, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * cos_stride_t + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * sin_stride_t + d, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * sin_stride_t + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, q_stride_t, q_stride_h, qo_stride_t, qo_stride_h, tok, n_q_heads,
                  c1, s1, c2, s2, HALF, BLOCK_D, BLOCK_HQ)


def _check_heads(name: str, x: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be (tokens, heads, even head_dim) with unit last stride, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")


def _out_like(x: torch.Tensor, out: torch.Tensor | None, dtype: torch.dtype, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=dtype, device=x.device)
    if out.shape != x.shape or out.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    _check_heads(name, out)
    return out


def _num_warps(tile: int) -> int:
    return 4 if tile <= 4096 else 8


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `apply_rotary_reference`: x (tokens, heads, head_dim), cos/sin (tokens, head_dim); the
    result has torch's promoted dtype of (x, cos, sin)."""
    _check_heads("x", x)
    rows = (x.shape[0], x.shape[2])
    if cos.shape != rows or sin.shape != rows:
        raise ValueError(f"cos/sin must be {rows}, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    dtype = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)
    out = _out_like(x, out, dtype, "out")
    n_tokens, n_heads, head_dim = x.shape
    if n_tokens == 0:
        return out
    block_d, block_h = next_power_of_2(head_dim // 2), next_power_of_2(n_heads)
    _rotary_kernel[(n_tokens,)](
        x, out, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        n_heads, HALF=head_dim // 2, BLOCK_D=block_d, BLOCK_HQ=block_h, num_warps=_num_warps(block_h * block_d))
    return out
