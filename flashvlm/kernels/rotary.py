"""Rotary position embedding (rotate-half layout), 1-D RoPE and Qwen2-VL M-RoPE, one program per token.

Two entry points share one kernel:
- `rotary_qk_triton`: q and k together from positions; cos/sin are computed in the kernel (fp32 angle, then cast
  to the activation dtype), so no (tokens, head_dim) tables exist.
- `apply_rotary_triton`: one tensor with precomputed cos/sin rows, the drop-in for `layers.rotary.apply_rotary`.

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
from flashvlm.layers.rotary import apply_rotary_reference, rotary_cos_sin

__all__ = ["apply_rotary_triton", "rotary_qk_reference", "rotary_qk_triton"]

# How the kernel gets cos/sin.
_MODE_TABLES, _MODE_POS_1D, _MODE_POS_MROPE = 0, 1, 2


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
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, inv_freq_ptr, cos_ptr, sin_ptr,
                   q_stride_t, q_stride_h, k_stride_t, k_stride_h,
                   qo_stride_t, qo_stride_h, ko_stride_t, ko_stride_h,
                   pos_stride_axis, pos_stride_t, cos_stride_t, sin_stride_t,
                   n_q_heads, n_k_heads, scaling,
                   MODE: tl.constexpr, SEC0: tl.constexpr, SEC1: tl.constexpr, HAS_K: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    if MODE == 0:
        # Tables may hold different halves in general; load both rather than assume cat(freqs, freqs).
        c1 = tl.load(cos_ptr + tok * cos_stride_t + d, mask=dmask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * cos_stride_t + HALF + d, mask=dmask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * sin_stride_t + d, mask=dmask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * sin_stride_t + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    else:
        if MODE == 1:
            pos = tl.load(pos_ptr + tok * pos_stride_t).to(tl.float32)
        else:
            # M-RoPE with three sections: band d reads the temporal, height or width position.
            axis = (d >= SEC0).to(tl.int64) + (d >= SEC0 + SEC1).to(tl.int64)
            pos = tl.load(pos_ptr + axis * pos_stride_axis + tok * pos_stride_t, mask=dmask, other=0).to(tl.float32)
        # One fp32 multiply, like `positions.float() * inv_freq`, so the angle is the torch path's angle.
        angle = pos * tl.load(inv_freq_ptr + d, mask=dmask, other=0.0)
        ty = qo_ptr.dtype.element_ty
        # Cast to the activation dtype before the multiply, as the torch path's cos/sin tables are.
        c1 = (tl.cos(angle) * scaling).to(ty).to(tl.float32)
        s1 = (tl.sin(angle) * scaling).to(ty).to(tl.float32)
        c2 = c1
        s2 = s1
    _rotate_heads(q_ptr, qo_ptr, q_stride_t, q_stride_h, qo_stride_t, qo_stride_h, tok, n_q_heads,
                  c1, s1, c2, s2, HALF, BLOCK_D, BLOCK_HQ)
    if HAS_K:
        _rotate_heads(k_ptr, ko_ptr, k_stride_t, k_stride_h, ko_stride_t, ko_stride_h, tok, n_k_heads,
                      c1, s1, c2, s2, HALF, BLOCK_D, BLOCK_HK)


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


def _launch(q: torch.Tensor, k: torch.Tensor | None, qo: torch.Tensor, ko: torch.Tensor | None, *,
            mode: int, positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None,
            cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
            sections: tuple[int, int] = (0, 0), scaling: float = 1.0) -> None:
    n_tokens, n_q_heads, head_dim = q.shape
    if n_tokens == 0:
        return
    half = head_dim // 2
    kk, kko = (k, ko) if k is not None else (q, qo)  # placeholders; HAS_K=False never touches them
    if positions is None:
        pos, pos_strides = q, (0, 0)
    elif positions.dim() == 1:
        pos, pos_strides = positions, (0, positions.stride(0))
    else:
        pos, pos_strides = positions, (positions.stride(0), positions.stride(1))
    freq = inv_freq if inv_freq is not None else q
    cs, sn = (cos, sin) if cos is not None else (q, q)
    block_d = next_power_of_2(half)
    block_hq = next_power_of_2(n_q_heads)
    block_hk = next_power_of_2(kk.shape[1])
    _rotary_kernel[(n_tokens,)](
        q, kk, qo, kko, pos, freq, cs, sn,
        q.stride(0), q.stride(1), kk.stride(0), kk.stride(1),
        qo.stride(0), qo.stride(1), kko.stride(0), kko.stride(1),
        pos_strides[0], pos_strides[1],
        cos.stride(0) if cos is not None else 0, sin.stride(0) if sin is not None else 0,
        n_q_heads, kk.shape[1], float(scaling),
        MODE=mode, SEC0=sections[0], SEC1=sections[1], HAS_K=k is not None,
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        num_warps=_num_warps(max(block_hq, block_hk) * block_d),
    )


def rotary_qk_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                     mrope_section: list[int] | None = None, scaling: float = 1.0, *,
                     q_out: torch.Tensor | None = None,
                     k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (tokens, heads, head_dim) and k (tokens, kv_heads, head_dim); same dtype, any head/token
    strides. positions: (tokens,) or, with a three-part `mrope_section`, (3, tokens) (any strides, any integer
    dtype; 1-D positions with M-RoPE equal plain RoPE). inv_freq: float32 (head_dim/2,). Pass `q_out=q,
    k_out=k` to rotate in place; otherwise fresh tensors are returned."""
    _check_heads("q", q)
    _check_heads("k", k)
    if k.dtype != q.dtype or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"k {k.dtype} {tuple(k.shape)} does not match q {q.dtype} {tuple(q.shape)}")
    if positions.device != q.device or inv_freq.device != q.device:
        raise ValueError(f"positions ({positions.device}) and inv_freq ({inv_freq.device}) must be on {q.device}")
    half = q.shape[2] // 2
    if inv_freq.shape != (half,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32 ({half},), got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if positions.dim() == 1 or mrope_section is None:
        if positions.shape != (q.shape[0],):
            raise ValueError(f"positions must be ({q.shape[0]},), got {tuple(positions.shape)}")
        mode, sections = _MODE_POS_1D, (0, 0)
    else:
        if len(mrope_section) != 3 or sum(mrope_section) != half:
            raise ValueError(f"mrope_section {mrope_section} must have three parts summing to {half}")
        if positions.shape != (3, q.shape[0]):
            raise ValueError(f"positions must be (3, {q.shape[0]}), got {tuple(positions.shape)}")
        mode, sections = _MODE_POS_MROPE, (int(mrope_section[0]), int(mrope_section[1]))
    q_out = _out_like(q, q_out, q.dtype, "q_out")
    k_out = _out_like(k, k_out, k.dtype, "k_out")
    _launch(q, k, q_out, k_out, mode=mode, positions=positions, inv_freq=inv_freq.contiguous(),
            sections=sections, scaling=scaling)
    return q_out, k_out


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
    _launch(x, None, out, None, mode=_MODE_TABLES, cos=cos, sin=sin)
    return out


def rotary_qk_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                        mrope_section: list[int] | None = None,
                        scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path `rotary_qk_triton` must reproduce: tables in the activation dtype, then the rotation."""
    cos, sin = rotary_cos_sin(positions, inv_freq, scaling, q.dtype, mrope_section)
    return apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)
