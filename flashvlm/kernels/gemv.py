"""Skinny matrix products for decode: y (M, N) = x (M, K) @ W (N, K)^T (+ bias) for M <= 16 rows.

At small batch a decode step is one pass over the weights, so each projection should read its matrix at the
memory's speed. cuBLAS's choices for these shapes leave bandwidth unused on the H200 (Qwen2-7B at batch 1:
QKV at 2.9 TB/s, o_proj 2.3, gate/up 3.8, down 3.3 plus a split-K reduction kernel; scripts/gpu_gemv.py).

Here each program owns BLOCK_N output columns for all rows (padded to 16, the tensor cores' smallest M) and
streams its slice of W once through a `tl.dot` loop; many programs in flight hide the loads' latency.
Matrices with few column blocks (o_proj: 3584 columns) also split K over several programs, so every SM
streams; the partial sums go to a float32 workspace and the last program of a column block to finish (an
atomic arrival count) adds them in a fixed order and writes the output: one launch, deterministic. Its count
is reset by that program, so the counters (`locks`, int32 zeros, one per column block) can be reused by the
next call on the same stream and inside CUDA graphs.

Reference: `gemv_reference` (torch's linear). Tried and dropped: SiLU-and-mul fused into the down projection's
input loads ran ~10x slower than cuBLAS plus the separate activation kernel (scripts/gpu_gemv.py).
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["GemvConfig", "gemv_config", "gemv_lock_count", "gemv_reference", "gemv_triton"]

_ROWS = 16


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4


def with_gemv_tiles(num_stages: int = 4) -> Callable[[type], type]:
    """Decorates a NamedTuple of a GEMV variant's own options (each with a default) into its config type: GemvConfig's
    tile fields first (`num_stages` defaulting as given), then the options, in one flat NamedTuple of the
    decorated class's name and docstring. So the tiles stand at the same positions in every GEMV's config, and
    positional construction, `cfg.block_n`, `cfg._replace(...)` and `Config(*tuple(cfg))` work as for GemvConfig."""

    def build(options: type) -> type:
        if len(options._field_defaults) != len(options._fields):
            raise TypeError(f"{options.__name__}: every option needs a default (they follow the tile fields)")
        defaults = {**GemvConfig._field_defaults, "num_stages": num_stages, **options._field_defaults}
        config = namedtuple(options.__name__, GemvConfig._fields + options._fields, defaults=tuple(defaults.values()),
                            module=options.__module__)
        config.__qualname__ = options.__qualname__
        config.__doc__ = options.__doc__
        config.__annotations__ = {**GemvConfig.__annotations__, **options.__annotations__}
        return config

    return build


@triton.jit
def load_gemv_tiles(w_rows, x_rows, ks, k_end, col_ok, row_ok, EVEN_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile and the (ROWS, BLOCK_K) x tile at columns `ks` (zeros outside)."""
    if EVEN_K:  # K and k_per_split are multiples of BLOCK_K: only the column edge is masked
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None], other=0.0)
        x_mask = row_ok[:, None]
    else:
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < k_end)[None, :], other=0.0)
        x_mask = row_ok[:, None] & (ks < k_end)[None, :]
    return w, tl.load(x_rows + ks[None, :], mask=x_mask, other=0.0)


@triton.jit
def split_k_gather(acc, part_ptr, lock_ptr, pid_n, pid_k, num_splits, rows, cols, out_mask, N,
                   ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Publishes this split's partial sums (workspace (num_splits, ROWS, N) in acc's dtype: float32, or int32 for
    exact integer sums) and arrives at its column block's counter. Returns (last, total): whether this program
    arrived last and, if so, every split's partial added in split order (its counter then reset, ready for the
    next call); the caller writes the output."""
    parts = part_ptr + rows[:, None] * N + cols[None, :]
    tl.store(parts + pid_k * ROWS * N, acc, mask=out_mask)
    tl.debug_barrier()  # every thread's partial is written before the arrival is published
    arrived = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    last = arrived == num_splits - 1
    total = tl.zeros((ROWS, BLOCK_N), dtype=acc.dtype)
    if last:
        for s in range(num_splits):
            total += tl.load(parts + s * ROWS * N, mask=out_mask, other=0, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # no program of this call reads it again
    return last, total


@triton.jit
def gemv_program(x_ptr, w_ptr, M, N, K, k_per_split, x_stride, w_stride, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's share of a skinny product, as (pid_n, pid_k, cols, col_ok, rows, row_ok, w_rows, x_rows,
    k_start, k_end): column block pid_n (BLOCK_N columns, those < N valid) for all ROWS rows (those < M valid),
    w_rows and x_rows the weight and x rows' first inputs, and split pid_k's inputs k_start..k_end (< K). K and
    k_per_split may count blocks of inputs instead: the range is then in blocks."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = tl.arange(0, ROWS)
    row_ok = rows < M
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * w_stride
    x_rows = x_ptr + rows[:, None] * x_stride
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    return pid_n, pid_k, cols, col_ok, rows, row_ok, w_rows, x_rows, k_start, k_end


@triton.jit
def gemv_epilogue(acc, x_scale, ws_ptr, b_ptr, out_ptr, out_stride, part_ptr, lock_ptr, num_splits, pid_n, pid_k,
                  rows, row_ok, cols, col_ok, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                  SCALED: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Writes the program's output tile: its sums `acc` or, with SPLIT, every split's (added by the program that
    arrives last; split_k_gather). In float32: with SCALED, times x_scale[row] * w_scale[col] (the quantized
    products' scales; x_scale and ws_ptr are not read without it), plus the bias with HAS_BIAS, then rounded to
    the output's dtype."""
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT:
        last, acc = split_k_gather(acc, part_ptr, lock_ptr, pid_n, pid_k, num_splits, rows, cols, out_mask, N,
                                   ROWS, BLOCK_N)
    else:
        last = True
    if last:
        y = acc.to(tl.float32)
        if SCALED:
            y = y * x_scale[:, None] * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, k_per_split, num_splits,
                 x_stride, w_stride, out_stride,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    pid_n, pid_k, cols, col_ok, rows, row_ok, w_rows, x_rows, k_start, k_end = gemv_program(
        x_ptr, w_ptr, M, N, K, k_per_split, x_stride, w_stride, ROWS, BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, x = load_gemv_tiles(w_rows, x_rows, k0 + tl.arange(0, BLOCK_K), k_end, col_ok, row_ok, EVEN_K)
        acc = tl.dot(x, tl.trans(w), acc)
    # Not scaled: acc and b_ptr stand in for the scales, unread.
    gemv_epilogue(acc, acc, b_ptr, b_ptr, out_ptr, out_stride, part_ptr, lock_ptr, num_splits, pid_n, pid_k,
                  rows, row_ok, cols, col_ok, N, ROWS, BLOCK_N, SPLIT, False, HAS_BIAS)


def gemv_config(n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """Tile config for a (<= 16 rows) x (k x n) product, from scripts/gpu_gemv.py on the H200 (132 SMs; 1-16 rows;
    Qwen2-7B's shapes and the 4096-wide Qwen3-8B, Mistral-7B and Persimmon-8B): wide matrices (gate/up, lm_head)
    64 x 128 tiles with 3 stages; narrow ones 64 x 256 with 4, K split in two when the column blocks would occupy
    at most half the SMs (o_proj 3584 x 3584: 10.3 against cuBLAS's 11.5 us; down 3584 x 18944: 36.2 against
    38.8; down 4096 x 12288: 27.6 against 34.7 unsplit; 4096 x 14336: 31.6 against 40.3). QKV 4608 x 3584 (72
    blocks) is fastest unsplit (11.4 against 14.8 us split in three)."""
    if n >= 16384:
        return GemvConfig(64, 128, 1, 4, 3)
    return GemvConfig(64, 256, 2 if 2 * triton.cdiv(n, 64) <= num_sms and k >= 1024 else 1, 4, 4)


def gemv_lock_count(n: int, config: GemvConfig) -> int:
    """Arrival counters a split-K call needs: one per column block."""
    return triton.cdiv(n, config.block_n)


def gemv_shapes(x: torch.Tensor, weight: torch.Tensor, kernel: str) -> tuple[int, int, int]:
    """(M, N, K) of a skinny product, or a ValueError naming what `kernel` cannot take: operands not 2-D, K that
    differ, rows outside 1..16, weight rows not contiguous."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"{kernel} takes 2-D x and weight, got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} columns; the weight takes {k}")
    if not 0 < m <= _ROWS:
        raise ValueError(f"{kernel} takes 1..{_ROWS} rows, got {m}")
    if weight.stride(1) != 1:
        raise ValueError(f"{kernel} needs a weight whose rows are contiguous")
    return m, n, k


def split_k_buffers(out: torch.Tensor, k: int, rows: int, block_k: int, split_k: int, lock_count: int,
                    locks: torch.Tensor | None, part_dtype: torch.dtype = torch.float32,
                    ) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(K per split, splits, partials workspace (splits, rows, N) in part_dtype, arrival counters) for a launch
    writing `out` (M, N); without a split, both buffers are `out` (unused). No split is left empty."""
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    split = triton.cdiv(k, k_per_split)
    if split == 1:
        return k_per_split, 1, out, out
    if locks is None:
        locks = torch.zeros(lock_count, dtype=torch.int32, device=out.device)
    elif locks.dtype != torch.int32 or locks.numel() < lock_count or locks.device != out.device:
        raise ValueError(f"locks must be >= {lock_count} int32 zeros on {out.device}")
    part = torch.empty((split, rows, out.shape[1]), dtype=part_dtype, device=out.device)
    return k_per_split, split, part, locks


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                config: GemvConfig | None = None,
                locks: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) for M <= 16; `weight` is (N, K) with contiguous rows.

    A split-K config needs `locks`: int32 zeros on x's device, at least `gemv_lock_count` of them, not used by
    another call at the same time (the layers own one buffer each); None allocates fresh ones."""
    m, n, k = gemv_shapes(x, weight, "gemv")
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv runs bf16 or fp16 on the GPU (tl.dot would round {x.dtype} to TF32)")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or gemv_config(n, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split, split, part, locks = split_k_buffers(out, k, _ROWS, cfg.block_k, cfg.split_k,
                                                      gemv_lock_count(n, cfg), locks)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, bias if bias is not None else weight, out, part, locks, m, n, k,
        k_per_split, split, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1, HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)
