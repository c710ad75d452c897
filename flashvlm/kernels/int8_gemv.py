"""INT8 W8A8 products: y (M, N) = dequant(quant(x) (M, K) @ W_q (N, K)^T) (+ bias), in x's dtype.

Weights are int8 with one float32 scale per output channel (s_w, (N,)). Activations are quantized per token:
s_x[m] = amax(|x[m]|) / 127 and x_q = round_half_even(x * (1 / s_x)) clamped to [-127, 127] (dynamic), or with one
per-tensor scale from the checkpoint (static). The product of the integers is summed in int32, which is exact:
|x_q * w_q| <= 127 * 128, so K up to 131,072 cannot overflow, and an integer sum does not depend on its order,
so split-K partials add to the same answer however the programs finish. (float32 accumulation would round once
the sums pass 2^24, which Qwen2-7B's K of 18,944 can reach.) The epilogue is acc * s_x[m] * s_w[n] (+ bias).

Decode rows (M <= 16) take `w8a8_gemv`: the bf16 GEMV's layout (kernels/gemv.py: BLOCK_N columns for all rows
padded to 16, W streamed once through a `tl.dot` loop, split-K with an arrival counter for narrow matrices) with
int8 weights, half the bytes, on x quantized by one `quantize_rows` launch first. (The kernel can also quantize x
itself up to `fuse_max_rows` rows, each program reading its rows of x for their amax through
kernels/act_scales.py; measured slower, it is off by default.) Larger M takes
`torch._int_mm` (cuBLAS int8, int32 out; CUDA needs M > 16 and K, N multiples of 8) between `quantize_rows`
and the one-pass epilogue `dequantize_product_triton` (kernels/int8_torch.py: int_mm_w8a8).

Rounding is round-half-to-even written with floor (`_round_half_even`): libdevice's rint does not run in Triton's
interpreter, and the floor form is exact for the magnitudes involved. The scale and its reciprocal are IEEE
divisions (`div_rn`, once per row) and each value is multiplied by the reciprocal (a division per element would
cost the GEMV more than its loads), so the quantized activations match torch's `x * (1 / s)` bit for bit.
References (kernels/int8_torch.py, no Triton):
`w8a8_reference` (float64 products of the integers: exact, on any device) and `quantize_rows_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashvlm.kernels.act_scales import PROLOGUE_UNROLL, prologue_shape, quantize_warps, row_amax
from flashvlm.kernels.gemv import gemv_epilogue, gemv_program, load_gemv_tiles, split_k_buffers, with_gemv_tiles
from flashvlm.kernels.int8_torch import check_w8a8_operands

__all__ = ["Int8GemvConfig", "dequantize_product_triton", "int8_gemv_config", "int8_gemv_lock_count",
           "quantize_rows", "w8a8_gemv"]

_ROWS = 16
_EPILOGUE_M, _EPILOGUE_N = 16, 256
_QUANT_BLOCK = 32768  # a row of up to this many inputs is quantized in one pass

# How x reaches the kernel: float rows quantized per token, float rows with one static scale, or rows already
# quantized (int8 with their per-row scales, from quantize_rows).
X_DYNAMIC, X_STATIC, X_QUANTIZED = 0, 1, 2


@with_gemv_tiles(num_stages=4)
class Int8GemvConfig(NamedTuple):
    """GemvConfig's tiles, then the INT8 option."""

    fuse_max_rows: int = 0
    """Dynamic quantization inside the GEMV up to this many rows; more rows take quantize_rows first. Measured on
    the H200 (scripts/gpu_int8_gemv.py), quantize_rows first is faster at every row count (QKV at 1 row: 9.4 us
    against 94 fused), so the default never fuses."""


@triton.jit
def _round_half_even(v):
    f = tl.floor(v)
    d = v - f  # exact: |v| is at most a few hundred here
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit
def quantize_int8(xv, inv_scale):
    """float32 values times their reciprocal scale -> int8 in [-127, 127], rounded half to even."""
    q = _round_half_even(xv * inv_scale)
    return tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)


@triton.jit
def int8_scale(amax):
    """amax / 127, IEEE division (tensors of one shape: div_rn takes no scalar)."""
    return tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))


@triton.jit
def int8_reciprocal(scale):
    """1 / scale, the factor the values are multiplied by; 1 where the scale is 0 (an all-zero or padding row,
    whose values quantize to 0)."""
    return tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), tl.where(scale > 0.0, scale, 1.0))


@triton.jit(do_not_specialize=["M"])  # one binary for every batch size: graphs capture many
def _w8a8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, k_per_split,
                      num_splits, x_stride, w_stride, out_stride,
                      ROWS: tl.constexpr, PRO_ROWS: tl.constexpr, PRO_K: tl.constexpr, PRO_UNROLL: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                      HAS_BIAS: tl.constexpr, X_MODE: tl.constexpr, EVEN_K: tl.constexpr):
    pid_n, pid_k, cols, col_ok, rows, row_ok, w_rows, x_rows, k_start, k_end = gemv_program(
        x_ptr, w_ptr, M, N, K, k_per_split, x_stride, w_stride, ROWS, BLOCK_N)
    if X_MODE == 0:
        x_scale = int8_scale(row_amax(x_ptr, M, K, x_stride, ROWS, PRO_ROWS, PRO_K, PRO_UNROLL))
    elif X_MODE == 1:
        x_scale = tl.zeros((ROWS,), dtype=tl.float32) + tl.load(xs_ptr).to(tl.float32)
    else:
        x_scale = tl.load(xs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    inv_scale = int8_reciprocal(x_scale)  # unused for x already quantized
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, xv = load_gemv_tiles(w_rows, x_rows, k0 + tl.arange(0, BLOCK_K), k_end, col_ok, row_ok, EVEN_K)
        if X_MODE == 2:
            xq = xv
        else:
            xq = quantize_int8(xv.to(tl.float32), inv_scale[:, None])
        acc = tl.dot(xq, tl.trans(w), acc, out_dtype=tl.int32)
    # int32 partials: the splits add exactly
    gemv_epilogue(acc, x_scale, ws_ptr, b_ptr, out_ptr, out_stride, part_ptr, lock_ptr, num_splits, pid_n, pid_k,
                  rows, row_ok, cols, col_ok, N, ROWS, BLOCK_N, SPLIT, True, HAS_BIAS)


@triton.jit
def _quantize_rows_kernel(x_ptr, xs_ptr, q_ptr, s_ptr, K, x_stride, q_stride, BLOCK: tl.constexpr,
                          STATIC: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    offs = tl.arange(0, BLOCK)
    # The scale is kept as a vector of BLOCK equal values: div_rn takes tensors of one shape.
    if ONE_PASS:  # the whole row in one load, kept in registers for the rounding
        xv = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.abs(xv)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
    if STATIC:
        scale = tl.zeros((BLOCK,), dtype=tl.float32) + tl.load(xs_ptr).to(tl.float32)
    else:
        scale = int8_scale(tl.zeros((BLOCK,), dtype=tl.float32) + tl.max(amax, axis=0))
    inv = int8_reciprocal(scale)
    if ONE_PASS:
        tl.store(q_ptr + row * q_stride + offs, quantize_int8(xv, inv), mask=offs < K)
    else:
        for k0 in range(0, K, BLOCK):
            ks = k0 + offs
            xv = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            tl.store(q_ptr + row * q_stride + ks, quantize_int8(xv, inv), mask=ks < K)
    tl.store(s_ptr + row + offs * 0, scale, mask=offs == 0)


@triton.jit
def _dequantize_kernel(acc_ptr, xs_ptr, ws_ptr, b_ptr, out_ptr, M, N, acc_stride, out_stride,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    acc = tl.load(acc_ptr + rows.to(tl.int64)[:, None] * acc_stride + cols[None, :], mask=mask, other=0)
    x_scale = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
    w_scale = tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


def dequantize_product_triton(acc: torch.Tensor, x_scale: torch.Tensor, weight_scale: torch.Tensor,
                              bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """int32 acc (M, N) * s_x[m] * s_w[n] (+ bias) -> dtype in one pass (the torch epilogue takes four: at a
    prefill of 4,096 rows x 37,888 columns each pass moves 0.6 GB)."""
    m, n = acc.shape
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    if acc.stride(1) != 1:
        acc = acc.contiguous()
    if m and n:
        grid = (triton.cdiv(m, _EPILOGUE_M), triton.cdiv(n, _EPILOGUE_N))
        _dequantize_kernel[grid](acc, x_scale.contiguous(), weight_scale.reshape(-1).contiguous(),
                                 bias if bias is not None else weight_scale, out, m, n, acc.stride(0), out.stride(0),
                                 BLOCK_M=_EPILOGUE_M, BLOCK_N=_EPILOGUE_N, HAS_BIAS=bias is not None)
    return out


def int8_gemv_config(n: int, k: int) -> Int8GemvConfig:
    """The bf16 GEMV's tiles (kernels/gemv.py: gemv_config) at the same bytes per pipeline stage: wide matrices
    (gate/up) 64 x 256 with 3 stages, narrow ones 64 x 512 with 4, K split in two when there are fewer than 64
    column blocks. On the H200 after quantize_rows (scripts/gpu_int8_gemv.py, 1 row): QKV 9.4 us, o_proj 9.6,
    gate/up 37.2, down 26.3 (bf16 GEMV: 11.5, 10.2, 63.5, 35.7); no grid config beat them by more than 1 us."""
    if n >= 16384:
        return Int8GemvConfig(64, 256, 1, 4, 3)
    return Int8GemvConfig(64, 512, 2 if triton.cdiv(n, 64) < 64 and k >= 1024 else 1, 4, 4)


def int8_gemv_lock_count(n: int, config: Int8GemvConfig) -> int:
    """Arrival counters a split-K call needs: one per column block."""
    return triton.cdiv(n, config.block_n)


def w8a8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
              *, x_scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
              config: Int8GemvConfig | None = None, locks: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) for M <= 16 in out_dtype (default x's dtype). `weight` int8 (N, K), `weight_scale`
    float32 (N,). x float: quantized per token, or with the static per-tensor `x_scale` (1 value). x int8: already
    quantized, `x_scale` its (M,) float32 row scales (out_dtype then required). `locks` as for gemv_triton."""
    m, n, k = check_w8a8_operands(x, weight, weight_scale)
    if not 0 < m <= _ROWS:
        raise ValueError(f"w8a8_gemv takes 1..{_ROWS} rows, got {m}")
    if x.dtype == torch.int8:
        if x_scale is None or x_scale.numel() != m or x_scale.dtype != torch.float32 or out_dtype is None:
            raise ValueError("int8 x needs its (M,) float32 row scales as x_scale and an out_dtype")
        mode = X_QUANTIZED
    else:
        if x_scale is not None and x_scale.numel() != 1:
            raise ValueError("a static x_scale is one per-tensor value")
        mode = X_DYNAMIC if x_scale is None else X_STATIC
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or int8_gemv_config(n, k)
    if mode == X_DYNAMIC and m > cfg.fuse_max_rows:
        out_dtype = out_dtype or x.dtype
        x, x_scale = quantize_rows(x)
        mode = X_QUANTIZED
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    k_per_split, split, part, locks = split_k_buffers(out, k, _ROWS, cfg.block_k, cfg.split_k,
                                                      int8_gemv_lock_count(n, cfg), locks, part_dtype=torch.int32)
    pro_rows, pro_k = prologue_shape(m, k)
    _w8a8_gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, x_scale if x_scale is not None else weight_scale, weight, weight_scale,
        bias if bias is not None else weight_scale, out, part, locks, m, n, k,
        k_per_split, split, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=_ROWS, PRO_ROWS=pro_rows, PRO_K=pro_k, PRO_UNROLL=PROLOGUE_UNROLL, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT=split > 1, HAS_BIAS=bias is not None, X_MODE=mode,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def quantize_rows(x: torch.Tensor, x_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (int8 (M, K), float32 (M,) scales): per token, or with a static per-tensor scale."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows takes 2-D x, got {tuple(x.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block = min(_QUANT_BLOCK, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, x_scale if x_scale is not None else scales, q, scales, k, x.stride(0),
                                    q.stride(0), BLOCK=block, STATIC=x_scale is not None, ONE_PASS=block >= k,
                                    num_warps=quantize_warps(block))
    return q, scales
