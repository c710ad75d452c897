"""INT8 W8A8 in plain torch: the reference of kernels/int8_gemv.py, and the many-row path through cuBLAS's int8
GEMM (`torch._int_mm`). No Triton here, so CPU processes and `kernel_backend="torch"` never import it.

The numbers (see int8_gemv.py): s_x[m] = amax(|x[m]|) / 127 per token (or one static per-tensor scale),
x_q = round_half_even(x * (1 / s_x)) clamped to [-127, 127]; int8 weights with float32 per-output-channel scales;
y = (x_q @ W_q^T) * s_x[m] * s_w[n] (+ bias), the integer product exact.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QMAX = 127.0
_INT_MM_MIN_ROWS = 17
"""CUDA's _int_mm takes more than 16 rows."""

Quantizer = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
Epilogue = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.dtype], torch.Tensor]


def check_w8a8_operands(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int, int]:
    """(M, N, K) of a W8A8 product, after checking the operands' shapes, dtypes and layouts."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"w8a8 takes 2-D x and weight, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns; the weight takes {k}")
    if weight.dtype != torch.int8 or weight.stride(1) != 1:
        raise ValueError("w8a8 needs an int8 weight whose rows are contiguous")
    if weight_scale.dtype != torch.float32 or weight_scale.numel() != n or not weight_scale.is_contiguous():
        raise ValueError(f"weight_scale must be {n} contiguous float32 values (one per output channel)")
    return m, n, k


def quantize_rows_reference(x: torch.Tensor,
                            x_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (int8 (M, K), float32 (M,) scales), per token or with one static scale (torch.round
    rounds half to even). A row whose scale is 0 quantizes to zeros."""
    xf = x.float()
    if x_scale is None:
        amax = xf.abs().amax(dim=-1)
        scale = amax / torch.full_like(amax, QMAX)  # IEEE division on CUDA too (see quant/fp8_math.scale_of)
    else:
        scale = x_scale.float().reshape(1).expand(xf.shape[0])
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf * (1.0 / safe[:, None])).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.contiguous()


def quantize_weight_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 of a float (N, K) weight: (int8 (N, K), float32 (N,) scales), amax / 127
    per output channel (the activations' rule, applied to the weight's rows)."""
    return quantize_rows_reference(weight)


def dequantize_product(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The integer product (exact integers in any dtype) times s_x[m] * s_w[n], plus bias, in `dtype`."""
    out = acc.float() * x_scale[:, None] * weight_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(dtype)


def int_mm_applies(n: int, k: int) -> bool:
    """cuBLAS's int8 GEMM (torch._int_mm) takes K and N in multiples of 8."""
    return n % 8 == 0 and k % 8 == 0 and k > 0 and n > 0


def int_mm_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                *, x_scale: torch.Tensor | None = None, quantize: Quantizer = quantize_rows_reference,
                epilogue: Epilogue | None = None) -> torch.Tensor:
    """The many-row path: quantize x (`quantize`: the Triton `quantize_rows` or the torch reference), then
    `torch._int_mm` (int32 out), then `epilogue` (the Triton `dequantize_product_triton`, or by default
    `dequantize_product` in torch). On CUDA fewer than 17 rows are padded with zero rows; K and N must be
    multiples of 8 (`int_mm_applies`)."""
    m, n, k = check_w8a8_operands(x, weight, weight_scale)
    xq, scale = quantize(x, x_scale)
    if x.is_cuda and m < _INT_MM_MIN_ROWS:
        xq = torch.cat([xq, xq.new_zeros(_INT_MM_MIN_ROWS - m, k)])
    acc = torch._int_mm(xq, weight.t())[:m]
    return (epilogue or dequantize_product)(acc, scale, weight_scale, bias, x.dtype)


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, *, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, any device and row count: quantize x, multiply the integers in float64 (exact: every partial
    sum is an integer below 2^53), the same epilogue."""
    check_w8a8_operands(x, weight, weight_scale)
    xq, scale = quantize_rows_reference(x, x_scale)
    acc = xq.double() @ weight.double().t()
    return dequantize_product(acc, scale, weight_scale, bias, x.dtype)
