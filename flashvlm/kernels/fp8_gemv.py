"""FP8 decode projections: y (M, N) = dequant(quant(x) (M, K) @ W (N, K)^T) (+ bias) for M <= 16 rows, with e4m3
weights (per-output-channel float32 scales) and per-token e4m3 activations (kernels/fp8_quant.py's scheme).

The bf16 GEMV's structure (kernels/gemv.py) at half the weight bytes: each program owns BLOCK_N output columns for
all rows and streams its slice of W once, K split over several programs when there are few column blocks (the
same arrival counters, `locks`, reset by the last program of each column block: one launch, deterministic, and
reusable inside CUDA graphs).

With a dynamic scale, x is quantized by one small launch first (`quantize_fp8_per_token`) and the GEMV reads
e4m3 x. The GEMV can quantize x itself up to `fuse_max_rows` rows: every program then first reads its rows of x
whole (kernels/act_scales.py) for their amax and quantizes each x tile in registers before its product; on the
H200 that measured slower at every row count, so the default never fuses. A static input scale needs no amax: x
is always quantized inside the GEMV then.

The product of a tile, `dot`: "fp8" is tl.dot on the e4m3 tiles (rows padded to 16, the tensor cores' smallest
M); "f16" widens both e4m3 tiles to fp16 (exact) for a fp16 tl.dot; "fma" is a float32 multiply-add reduction
without the padding (up to 4 rows). All three multiply exact e4m3 values and accumulate in float32 (Hopper's
fp8 tensor cores are reported to keep fewer bits inside an accumulation: the tests allow 2^-12 of the terms).

Reference: `fp8_gemv_reference`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from flashvlm.kernels.act_scales import PROLOGUE_UNROLL, prologue_shape, row_amax
from flashvlm.kernels.dispatch import interpreter_active, next_power_of_2
from flashvlm.kernels.fp8_quant import (
    FP8_ACT_EPS,
    quantize_fp8_per_token,
    quantize_fp8_per_token_reference,
    quantize_tile,
)
from flashvlm.kernels.gemv import (
    gemv_epilogue,
    gemv_program,
    gemv_shapes,
    load_gemv_tiles,
    split_k_buffers,
    with_gemv_tiles,
)

__all__ = ["Fp8GemvConfig", "fp8_gemv", "fp8_gemv_config", "fp8_gemv_lock_count", "fp8_gemv_reference"]

_ROWS = 16
_FMA_MAX_ROWS = 4
_DOTS = {"fp8": 0, "f16": 1, "fma": 2}


@with_gemv_tiles(num_stages=3)
class Fp8GemvConfig(NamedTuple):
    """GemvConfig's tiles (3 stages by default), then the FP8 options."""

    dot: str = "fp8"
    """"fp8", "f16" or "fma" (see the module docstring)."""
    fuse_max_rows: int = 0
    """Dynamic quantization inside the GEMV up to this many rows; more rows quantize x in a launch before it.
    Measured on the H200, the launch first is faster at every row count (gate/up at 1 row: 37.0 us against 62.5
    fused): each program's amax pass over x delays its first weight load more than a launch costs."""
    round_bits: bool | None = None
    """Round to e4m3 in float32 arithmetic before the conversion (kernels/fp8_quant.py); None: only under the
    interpreter, whose conversion rounds wrongly."""


@triton.jit(do_not_specialize=["M"])  # one binary for every batch size: graphs capture many
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, b_ptr, xs_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, k_per_split,
                     num_splits, x_stride, w_stride, out_stride, eps,
                     ROWS: tl.constexpr, PRO_ROWS: tl.constexpr, PRO_K: tl.constexpr, PRO_UNROLL: tl.constexpr,
                     BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, X_MODE: tl.constexpr, DOT: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ROUND_BITS: tl.constexpr):
    # X_MODE 0: x bf16/fp16, dynamic scales; 1: x bf16/fp16, one static scale at xs_ptr; 2: x e4m3, its row
    # scales at xs_ptr. DOT: 0 fp8 tl.dot, 1 fp16 tl.dot, 2 float32 multiply-add.
    pid_n, pid_k, cols, col_ok, rows, row_ok, w_rows, x_rows, k_start, k_end = gemv_program(
        x_ptr, w_ptr, M, N, K, k_per_split, x_stride, w_stride, ROWS, BLOCK_N)
    if X_MODE == 0:  # padding rows get eps / 448: their x is zeros, which quantize to zeros
        amax = row_amax(x_ptr, M, K, x_stride, ROWS, PRO_ROWS, PRO_K, PRO_UNROLL)
        x_scale = tl.math.div_rn(tl.maximum(amax, eps), 448.0)
    elif X_MODE == 1:
        x_scale = tl.zeros((ROWS,), dtype=tl.float32) + tl.load(xs_ptr)
    else:
        x_scale = tl.load(xs_ptr + rows, mask=row_ok, other=1.0)
    inv_scale = tl.math.div_rn(1.0, x_scale)[:, None]
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, q = load_gemv_tiles(w_rows, x_rows, k0 + tl.arange(0, BLOCK_K), k_end, col_ok, row_ok, EVEN_K)
        if X_MODE != 2:
            q = quantize_tile(q.to(tl.float32), inv_scale, ROUND_BITS)
        if DOT == 0:
            acc = tl.dot(q, tl.trans(w), acc)
        elif DOT == 1:
            acc = tl.dot(q.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
        else:
            acc += tl.sum(q.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    gemv_epilogue(acc, x_scale, ws_ptr, b_ptr, out_ptr, out_stride, part_ptr, lock_ptr, num_splits, pid_n, pid_k,
                  rows, row_ok, cols, col_ok, N, ROWS, BLOCK_N, SPLIT, True, HAS_BIAS)


def fp8_gemv_config(n: int, k: int) -> Fp8GemvConfig:
    """Tile config for a (<= 16 rows) x (k x n) e4m3 product, from scripts/gpu_fp8_gemv.py's grid on the H200
    (Qwen2-7B's shapes, 1-16 rows, x quantized by its own launch first): 64 x 256 tiles with 3 stages; K split
    four ways for the narrow matrices (QKV 10.4 us against 13.4 unsplit at 4 rows, down 24.7 against 26.4)."""
    if n >= 16384:
        return Fp8GemvConfig(64, 256, 1, 4, 3)
    return Fp8GemvConfig(64, 256, 4 if k >= 1024 else 1, 4, 3)


def fp8_gemv_lock_count(n: int, config: Fp8GemvConfig) -> int:
    """Arrival counters a split-K call needs: one per column block (cdiv(n, 16) always suffice)."""
    return triton.cdiv(n, config.block_n)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
           input_scale: torch.Tensor | None, cfg: Fp8GemvConfig) -> None:
    """A ValueError naming what fp8_gemv cannot take (past gemv_shapes' checks)."""
    m, n = x.shape[0], weight.shape[0]
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_gemv takes bf16 or fp16 activations, got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_gemv needs a float8_e4m3fn weight, got {weight.dtype}")
    if weight_scale.shape != (n,) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be ({n},) float32, got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be ({n},) {x.dtype}, got {bias.dtype} {tuple(bias.shape)}")
    if input_scale is not None and (input_scale.numel() != 1 or input_scale.dtype != torch.float32):
        raise ValueError(f"input_scale must be one float32 value, got {input_scale.dtype} {tuple(input_scale.shape)}")
    if cfg.dot not in _DOTS or (cfg.dot == "fma" and m > _FMA_MAX_ROWS):
        raise ValueError(f"dot {cfg.dot!r} with {m} rows: 'fp8' or 'f16', or 'fma' up to {_FMA_MAX_ROWS} rows")
    if cfg.block_n < 16 or cfg.block_k < 32:
        raise ValueError(f"blocks of at least 16 columns and 32 of K, got {cfg.block_n} x {cfg.block_k}")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
             *, input_scale: torch.Tensor | None = None, locks: torch.Tensor | None = None,
             config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x (M, K) bf16/fp16, 1 <= M <= 16 -> (M, N) in x's dtype; `weight` (N, K) float8_e4m3fn with contiguous rows,
    `weight_scale` (N,) float32, `bias` (N,) in x's dtype; `input_scale` ((1,) float32): a static activation scale
    instead of each row's amax / 448.

    A split-K config needs `locks`: int32 zeros on x's device, at least `fp8_gemv_lock_count` of them, not used by
    another call at the same time (the layers own one buffer each); None allocates fresh ones."""
    m, n, k = gemv_shapes(x, weight, "fp8_gemv")
    cfg = config or fp8_gemv_config(n, k)
    _check(x, weight, weight_scale, bias, input_scale, cfg)
    round_bits = interpreter_active() if cfg.round_bits is None else cfg.round_bits
    out_dtype = x.dtype
    if x.stride(1) != 1:
        x = x.contiguous()
    x_scale = input_scale
    x_mode = 1 if input_scale is not None else 0
    if input_scale is None and m > cfg.fuse_max_rows:
        x, x_scale = quantize_fp8_per_token(x, round_bits=round_bits)
        x_mode = 2
    rows = next_power_of_2(m) if cfg.dot == "fma" else _ROWS
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    k_per_split, split, part, locks = split_k_buffers(out, k, rows, cfg.block_k, cfg.split_k,
                                                      fp8_gemv_lock_count(n, cfg), locks)
    pro_rows, pro_k = prologue_shape(m, k)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, weight_scale, bias if bias is not None else weight_scale, x_scale if x_scale is not None else
        weight_scale, out, part, locks, m, n, k, k_per_split, split, x.stride(0), weight.stride(0), out.stride(0),
        FP8_ACT_EPS, ROWS=rows, PRO_ROWS=pro_rows, PRO_K=pro_k, PRO_UNROLL=PROLOGUE_UNROLL,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, X_MODE=x_mode, DOT=_DOTS[cfg.dot], SPLIT=split > 1,
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        ROUND_BITS=round_bits, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def fp8_gemv_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, *, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: per-token quantization as fp8_quant's reference, the e4m3 product in float32, then
    (product * row scale) * column scale + bias, rounded once to x's dtype."""
    q, scales = quantize_fp8_per_token_reference(x, input_scale)
    y = (q.float() @ weight.float().t()) * scales * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
