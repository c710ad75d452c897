"""Per-token FP8 (e4m3) activation quantization: x (M, K) bf16/fp16 -> q (M, K) float8_e4m3fn, scales (M, 1) float32.

The scheme, shared by the FP8 GEMV (kernels/fp8_gemv.py, which fuses it) and the prefill path (`torch._scaled_mm`
takes the activations already quantized): a row's scale is s = max(amax|x_row|, FP8_ACT_EPS) / 448 (dynamic) or
the checkpoint's static scale; q = e4m3(clamp(x * (1 / s), -448, 448)), rounded to nearest even. Both divisions are
IEEE (`div_rn`, once per row) and the per-element step is a multiply by the reciprocal, so the kernels and the
reference produce the same bytes.

Rounding to e4m3: compiled kernels use the hardware conversion (`.to(tl.float8e4nv)`, round to nearest even).
Triton's CPU interpreter gets that conversion wrong whenever rounding carries into the exponent (31.06 becomes
16, not 32), so under the interpreter the kernels round in float32 arithmetic first (`round_to_e4m3`, exact), after
which the conversion has nothing left to round. The compiled kernels can take that path too (`round_bits=True`);
the GPU tests check that both agree with the reference.

Reference: `quantize_fp8_per_token_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.act_scales import quantize_warps
from flashvlm.kernels.dispatch import interpreter_active, next_power_of_2

__all__ = ["FP8_ACT_EPS", "FP8_MAX", "quantize_fp8_per_token", "quantize_fp8_per_token_reference", "round_to_e4m3"]

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
FP8_ACT_EPS = 1e-12
"""Floor on a row's amax, so an all-zero row gets a finite scale (and quantizes to zeros)."""
_MAX_BLOCK = 32768  # a row of up to this many inputs is quantized in one pass


@triton.jit
def round_to_e4m3(v):
    """float32 v with |v| <= 448 -> the nearest e4m3 value (ties to even), still float32; exact in float32 ops.

    Normal e4m3 numbers keep 3 of float32's 23 mantissa bits: add half of the dropped part (plus the kept
    lowest bit, for ties to even) to the bit pattern and clear it; a carry moves into the exponent as it should.
    Below 2^-6 e4m3 is subnormal with a fixed step of 2^-9: adding and removing 2^14 (whose float32 step is 2^-9)
    rounds |v| to that step."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    mag = tl.abs(v)
    tiny = ((mag + 16384.0) - 16384.0).to(tl.int32, bitcast=True) | (bits & -2147483648)
    return tl.where(mag < 0.015625, tiny.to(tl.float32, bitcast=True), normal)


@triton.jit
def quantize_tile(x, inv_scale, ROUND_BITS: tl.constexpr):
    """float32 tile times its reciprocal scale -> e4m3, as the module docstring says."""
    v = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    if ROUND_BITS:
        v = round_to_e4m3(v)
    return v.to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, K, x_stride, q_stride, eps,
                          BLOCK: tl.constexpr, STATIC: tl.constexpr, ROUND_BITS: tl.constexpr,
                          ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    if ONE_PASS:  # the whole row in one load, kept in registers for the rounding
        ks = tl.arange(0, BLOCK)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        amax = tl.abs(x)
    elif not STATIC:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), eps), 448.0)
    inv = tl.math.div_rn(1.0, scale)
    if ONE_PASS:
        tl.store(q_ptr + row * q_stride + ks, quantize_tile(x, inv, ROUND_BITS), mask=ks < K)
    else:
        for k0 in range(0, K, BLOCK):
            ks = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * q_stride + ks, quantize_tile(x, inv, ROUND_BITS), mask=ks < K)
    tl.store(scale_ptr + row, scale)


def quantize_fp8_per_token(x: torch.Tensor, *, input_scale: torch.Tensor | None = None,
                           round_bits: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) bf16/fp16 -> (q (M, K) float8_e4m3fn, scales (M, 1) float32), one program per row.

    `input_scale` ((1,) float32): a static scale for every row instead of each row's amax / 448 (the returned
    scales then repeat it). `round_bits`: see the module docstring (None: only under the interpreter)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_per_token takes a 2-D x, got shape {tuple(x.shape)}")
    if input_scale is not None and (input_scale.numel() != 1 or input_scale.dtype != torch.float32):
        raise ValueError(f"input_scale must be one float32 value, got {input_scale.dtype} {tuple(input_scale.shape)}")
    m, k = x.shape
    if k == 0:
        raise ValueError("quantize_fp8_per_token needs at least one column")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(_MAX_BLOCK, next_power_of_2(k))
        _quantize_rows_kernel[(m,)](
            x, q, scales, input_scale if input_scale is not None else scales, k, x.stride(0), q.stride(0),
            FP8_ACT_EPS, BLOCK=block, STATIC=input_scale is not None,
            ROUND_BITS=interpreter_active() if round_bits is None else round_bits, ONE_PASS=block >= k,
            num_warps=quantize_warps(block),
        )
    return q, scales


def quantize_fp8_per_token_reference(x: torch.Tensor, input_scale: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-torch form of `quantize_fp8_per_token` (same bytes)."""
    xf = x.float()
    if input_scale is None:
        amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=FP8_ACT_EPS)
        # A tensor divisor: CUDA torch turns division by a Python number into a multiply by its reciprocal,
        # which can differ from the kernel's IEEE division in the last bit.
        scales = amax / torch.full_like(amax, FP8_MAX)
    else:
        scales = input_scale.float().reshape(1, 1).expand(x.shape[0], 1).clone()
    q = (xf * (1.0 / scales)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales
