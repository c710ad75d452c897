"""Fused residual-add + LayerNorm (the Qwen2-VL vision blocks): one program per row reads x (and residual) once
and writes the normed output (and the new residual) once. Reference: `flashvlm.layers.norm.layer_norm_reference`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.dispatch import next_power_of_2
from flashvlm.kernels.rmsnorm import _MAX_BLOCK, _num_warps, _rows
from flashvlm.layers.norm import layer_norm_reference

__all__ = ["layer_norm_reference", "layernorm_triton"]


@triton.jit
def _layernorm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr,
                      x_stride, res_stride, out_stride, res_out_stride,
                      n_cols, eps,
                      HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0)
        # The sum rounded to the input dtype, as the torch path adds; the next block adds exactly this value.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean = tl.sum(h, axis=0) / n_cols
    centred = tl.where(mask, h - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Like torch's kernel: normalize, scale and shift in float32, one rounding to the output dtype.
    tl.store(out_ptr + row * out_stride + cols, (centred * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)


def layernorm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float):
    """Same contract as `layer_norm_reference`: `out`, or `(out, x + residual)` when `residual` is given. Inputs
    are never written."""
    n = x.shape[-1]
    if weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} / bias {tuple(bias.shape)} do not match hidden size {n}")
    block = next_power_of_2(n)
    if block > _MAX_BLOCK:
        raise ValueError(f"hidden size {n} exceeds the one-row-per-program limit {_MAX_BLOCK}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    x2, out2 = _rows(x, n), out.view(-1, n)
    residual_out = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        res2, res_out2 = _rows(residual, n), residual_out.view(-1, n)
    else:
        res2 = res_out2 = x2  # placeholders; HAS_RESIDUAL=False never touches them
    if x2.shape[0]:
        _layernorm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), bias.contiguous(), out2, res_out2,
            x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0),
            n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
        )
    return out if residual is None else (out, residual_out)
