"""SiLU-and-mul for packed gate/up projections: (tokens, 2*I) -> (tokens, I) in one pass, and quick_gelu
(x * sigmoid(1.702 x), the CLIP and Qwen2-VL vision MLPs) in one pass instead of three.
References: `flashvlm.layers.activation.silu_and_mul_reference`, `quick_gelu_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.dispatch import next_power_of_2
from flashvlm.layers.activation import quick_gelu_reference, silu_and_mul_reference

__all__ = ["quick_gelu_reference", "quick_gelu_triton", "silu_and_mul_reference", "silu_and_mul_triton"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    # torch rounds silu(gate) to the activation dtype before the multiply; IEEE division like torch's.
    act = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., 2*I) -> silu(x[..., :I]) * x[..., I:] of shape (..., I); `out` may be preallocated."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"last dim must be even (packed gate/up), got {two_i}")
    n = two_i // 2
    shape = (*x.shape[:-1], n)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or out.dtype != x.dtype:
        raise ValueError(f"out must be {x.dtype} {shape}, got {out.dtype} {tuple(out.shape)}")
    x2 = x.reshape(-1, two_i)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out2 = out.view(-1, n)
    if x2.shape[0] and n:
        block = min(_BLOCK, next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2, out2, x2.stride(0), out2.stride(0), n, BLOCK=block, num_warps=4 if block >= 512 else 2,
        )
    return out


@triton.jit
def _quick_gelu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    # torch's three ops, each rounded to the activation dtype: 1.702 * x, its sigmoid, x times that.
    z = (x * 1.702).to(ty).to(tl.float32)
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-z)).to(ty).to(tl.float32)
    tl.store(out_ptr + offs, (x * s).to(ty), mask=mask)


def quick_gelu_triton(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 * x), any shape: one read and one write of x (torch's three ops make three of each)."""
    xc = x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        _quick_gelu_kernel[(triton.cdiv(n, _BLOCK),)](xc, out, n, BLOCK=_BLOCK, num_warps=4)
    return out
