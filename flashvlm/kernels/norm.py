"""Fused residual-add + RMSNorm or LayerNorm: one program per row reads x (and residual) once and writes the
normed output (and the new residual) once. References: `flashvlm.layers.norm.rms_norm_reference` (the decoders,
Qwen2.5-VL's vision blocks) and `layer_norm_reference` (Qwen2-VL's vision blocks)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.dispatch import next_power_of_2
from flashvlm.layers.norm import layer_norm_reference, rms_norm_reference

_MAX_BLOCK = 65536  # one row must fit in registers; hidden sizes we serve are <= 8192

__all__ = ["layer_norm_reference", "layernorm_triton", "rms_norm_reference", "rmsnorm_triton"]


@triton.jit
def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
                 x_stride, res_stride, out_stride, res_out_stride,
                 n_cols, eps,
                 HAS_RESIDUAL: tl.constexpr, LAYER_NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype before normalizing: the torch path adds in that dtype and the
        # stored residual must be exactly the value the next layer adds.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if LAYER_NORM:
        centred = tl.where(mask, h - tl.sum(h, axis=0) / n_cols, 0.0)
        rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # Like torch's kernel: normalize, scale and shift in float32, one rounding to the output dtype.
        y = centred * rstd * w + b
    else:
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
        # Cast to the input dtype before the weight multiply, then multiply with one rounding to the output
        # dtype: the same two roundings as `weight * h.to(dtype)` in torch.
        y = w * (h * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.reshape(-1, n)
    return t if t.stride(1) == 1 else t.contiguous()


def _num_warps(block: int) -> int:
    if block <= 512:
        return 2
    if block <= 2048:
        return 4
    return 8 if block <= 8192 else 16


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
            eps: float, out: torch.Tensor, residual_out: torch.Tensor | None):
    n = x.shape[-1]
    block = next_power_of_2(n)
    if block > _MAX_BLOCK:
        raise ValueError(f"hidden size {n} exceeds the one-row-per-program limit {_MAX_BLOCK}")
    x2, out2 = _rows(x, n), out.view(-1, n)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res2, res_out2 = _rows(residual, n), residual_out.view(-1, n)
    else:
        res2 = res_out2 = x2  # placeholders; HAS_RESIDUAL=False never touches them
    if x2.shape[0]:
        weight = weight.contiguous()
        _norm_kernel[(x2.shape[0],)](
            x2, res2, weight, weight if bias is None else bias.contiguous(), out2, res_out2,
            x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, LAYER_NORM=bias is not None, BLOCK=block,
            num_warps=_num_warps(block),
        )
    return out if residual is None else (out, residual_out)


def rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                   out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """Same contract as `rms_norm_reference`: `out`, or `(out, x + residual)` when `residual` is given.

    `out` / `residual_out` may be preallocated (shape of x; out dtype = promote(weight, x)). Inputs are never
    written, so the caller's residual stream stays intact (a CUDA-graph input buffer may be the residual).
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    elif out.dtype != out_dtype or out.shape != x.shape:
        raise ValueError(f"out must be {out_dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    return _launch(x, residual, weight, None, eps, out, residual_out)


def layernorm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float):
    """Same contract as `layer_norm_reference`: `out` (x's dtype), or `(out, x + residual)`. Inputs are never
    written."""
    n = x.shape[-1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match hidden size {n}")
    return _launch(x, residual, weight, bias, eps, torch.empty(x.shape, dtype=x.dtype, device=x.device), None)
