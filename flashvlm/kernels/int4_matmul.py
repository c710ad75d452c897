"""W4A16 products: y (M, N) = x (M, K) @ W^T (+ bias) with W stored as 4-bit codes in the plane layout of
kernels/int4_layout.py, dequantized in registers ((u - zero) * scale in float32, rounded to x's dtype, the
product accumulated in float32 by `tl.dot`).

`w4a16_gemv` (M <= 16, decode): like the bf16 GEMV (kernels/gemv.py) each program owns BLOCK_N output columns
for all rows (padded to 16) and streams its slice of the packed weights once; a weight block of 256 inputs is
one (BLOCK_N, 32) int32 load, and each of its 8 nibble planes is one dot with 32 consecutive columns of x. A
4-bit matrix is a quarter of the bytes, so K is split over more programs to keep every SM streaming; the last
program of a column block to arrive adds the float32 partials in a fixed order (deterministic) and resets its
arrival counter, so the counters (`locks`) are reused by the next call and inside CUDA graphs.

`w4a16_gemm` (prefill): (BLOCK_M, BLOCK_N) output tiles, the same per-plane dots over K; programs that share a
column block run next to each other so its weights are read from L2 after the first.

Both compute what `int4_layout.w4a16_reference` computes (the same rounded weights) up to the order of the
float32 sums. Tile choices are fixed by shape, from scripts/gpu_int4_matmul.py --sweep on the H200; from
DEQUANTIZE_MIN_ROWS rows `w4a16_gemm` dequantizes the weight for cuBLAS instead.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flashvlm.kernels.gemv import gemv_epilogue, gemv_program, split_k_buffers
from flashvlm.kernels.int4_layout import BLOCK_K, PLANE, SYMMETRIC_ZERO, padded_k

__all__ = ["DEQUANTIZE_MIN_ROWS", "W4Config", "gemm_config", "gemv_config", "gemv_lock_count",
           "w4a16_dequantize_triton",
           "w4a16_gemm", "w4a16_gemv"]

_ROWS = 16


class W4Config(NamedTuple):
    block_n: int
    split_k: int = 1
    block_m: int = _ROWS
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    """GEMV only: the weight tile as the dot's first operand (out^T = W x^T): an M of BLOCK_N, not the padded
    16 rows, lets Hopper's wgmma take the dequantized tile from registers; False: x first, as the bf16 GEMV."""


@triton.jit
def _plane(words, i: tl.constexpr, scale, zero_magic, dtype: tl.constexpr):
    """Nibble plane i of a (BLOCK_N, 32) word tile, dequantized: (BLOCK_N, 32) in `dtype`. A code OR-ed into
    the mantissa of 2**23 (0x4B000000) is the float 2**23 + code, so no integer-to-float convert is needed;
    subtracting 2**23 + zero is exact."""
    code = ((words >> (4 * i)) & 15) | 0x4B000000
    return ((code.to(tl.float32, bitcast=True) - zero_magic[:, None]) * scale[:, None]).to(dtype)


@triton.jit
def _group_params(s_ptr, z_ptr, k, cols, col_ok, N, num_groups,
                  GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr):
    """The scale and 2**23 + zero of the group holding input k, for each column (float32)."""
    g = k // GROUP
    ok = col_ok & (g + 0 * cols < num_groups)  # a tensor condition: the interpreter rejects a scalar one
    scale = tl.load(s_ptr + g * N + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_ZERO:
        zero = tl.load(z_ptr + g * N + cols, mask=ok, other=0).to(tl.float32) + 8388608.0
    else:
        zero = tl.full(scale.shape, 8388608.0 + ZERO, tl.float32)
    return scale, zero


@triton.jit
def _block_product(acc, w_tile, x_tile, blk, j, row_ok, cols, col_ok, s_ptr, z_ptr, N, K, num_groups,
                   dtype: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr,
                   EVEN_K: tl.constexpr, SWAP: tl.constexpr):
    """acc plus the product of weight block blk (inputs blk * 256 ..., one (BLOCK_N, 32) word tile at w_tile) with
    x's rows at x_tile: one dot per nibble plane, its weights dequantized to `dtype`. acc is (rows, BLOCK_N), or
    its transpose with SWAP (the weights the dots' first operand)."""
    words = tl.load(w_tile + blk * 32, mask=col_ok[:, None], other=0)
    for i in tl.static_range(8):
        k = blk * 256 + i * 32
        scale, zero = _group_params(s_ptr, z_ptr, k, cols, col_ok, N, num_groups, GROUP, HAS_ZERO, ZERO)
        w = _plane(words, i, scale, zero, dtype)
        if EVEN_K:
            x = tl.load(x_tile + k, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(x_tile + k, mask=row_ok[:, None] & (k + j < K)[None, :], other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["M"])  # one binary for every batch size: graphs capture many
def _w4a16_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, part_ptr, lock_ptr,
                       M, N, K, num_groups, blocks_per_split, num_splits, x_stride, w_stride, out_stride,
                       GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZERO: tl.constexpr,
                       ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                       SWAP: tl.constexpr):
    # The split's range counts weight blocks of 256 inputs.
    pid_n, pid_k, cols, col_ok, rows, row_ok, w_rows, x_rows, first, end = gemv_program(
        x_ptr, w_ptr, M, N, tl.cdiv(K, 256), blocks_per_split, x_stride, w_stride, ROWS, BLOCK_N)
    j = tl.arange(0, 32)
    w_tile = w_rows + j[None, :]
    x_tile = x_rows + j[None, :]
    if SWAP:
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for blk in range(first, end):
        acc = _block_product(acc, w_tile, x_tile, blk, j, row_ok, cols, col_ok, s_ptr, z_ptr, N, K, num_groups,
                             out_ptr.dtype.element_ty, GROUP, HAS_ZERO, ZERO, EVEN_K, SWAP)
    if SWAP:
        acc = tl.trans(acc)
    # Not scaled: acc and b_ptr stand in for the scales, unread.
    gemv_epilogue(acc, acc, b_ptr, b_ptr, out_ptr, out_stride, part_ptr, lock_ptr, num_splits, pid_n, pid_k,
                  rows, row_ok, cols, col_ok, N, ROWS, BLOCK_N, SPLIT, False, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])  # one binary for every batch size: graphs capture many
def _w4a16_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, M, N, K, num_groups,
                       x_stride, w_stride, out_stride,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZERO: tl.constexpr,
                       ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the programs of one column block run together and share its weights
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    j = tl.arange(0, 32)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * w_stride + j[None, :]
    x_tile = x_ptr + rows.to(tl.int64)[:, None] * x_stride + j[None, :]
    ty = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for blk in range(0, tl.cdiv(K, 256)):
        acc = _block_product(acc, w_tile, x_tile, blk, j, row_ok, cols, col_ok, s_ptr, z_ptr, N, K, num_groups,
                             ty, GROUP, HAS_ZERO, ZERO, EVEN_K, False)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _w4_dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, num_groups, w_stride, out_stride,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, HAS_ZERO: tl.constexpr, ZERO: tl.constexpr):
    """One 256-input block of BLOCK_N rows of W, dequantized as the GEMM's tiles are, to out (N, K)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    blk = tl.program_id(1)
    j = tl.arange(0, 32)
    words = tl.load(w_ptr + cols.to(tl.int64)[:, None] * w_stride + blk * 32 + j[None, :], mask=col_ok[:, None],
                    other=0)
    outs = out_ptr + cols.to(tl.int64)[:, None] * out_stride + j[None, :]
    for i in tl.static_range(8):
        k = blk * 256 + i * 32
        scale, zero = _group_params(s_ptr, z_ptr, k, cols, col_ok, N, num_groups, GROUP, HAS_ZERO, ZERO)
        tl.store(outs + k, _plane(words, i, scale, zero, out_ptr.dtype.element_ty),
                 mask=col_ok[:, None] & (k + j < K)[None, :])


DEQUANTIZE_MIN_ROWS = 128
"""Rows from which w4a16_gemm dequantizes the weight for cuBLAS rather than running its fused kernel: faster at
every Qwen2-7B shape from 128 rows on the H200 (gate/up at 512 rows: 302 us against 605; at 64 rows the fused
kernel still wins gate/up)."""


def gemv_config(n: int, k: int) -> W4Config:
    """From scripts/gpu_int4_matmul.py --sweep on the H200 (Qwen2-7B's shapes, 1-16 rows, group 128): 2 stages;
    128-column blocks past 4,096 columns, else 64; K split 4 ways for gate/up, 8 for the other narrow-K
    matrices, 16 for down (us at 1 row: QKV 12.1, o_proj 10.3, gate/up 52.3, down 34.1: about the bf16 GEMV's
    times, so the decode product is bound by its dequantization, not its 4-bit loads)."""
    block_n = 128 if n > 4096 else 64
    if n >= 16384:
        return W4Config(block_n, 4, _ROWS, 4, 2)
    return W4Config(block_n, 16 if k >= 16384 else 8, _ROWS, 4, 2)


def gemm_config(m: int, n: int) -> W4Config:
    if m <= 64:
        return W4Config(128, 1, 64, 4, 2)
    return W4Config(128, 1, 128, 8, 2)


def gemv_lock_count(n: int, config: W4Config) -> int:
    """Arrival counters a split-K call needs: one per column block."""
    return triton.cdiv(n, config.block_n)


def _check(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
           group_size: int) -> None:
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"w4a16 takes 2-D x and a 2-D int32 qweight, got {tuple(x.shape)} and "
                         f"{tuple(qweight.shape)} {qweight.dtype}")
    n, k = qweight.shape[0], x.shape[1]
    if qweight.shape[1] * 8 != padded_k(k) or qweight.stride(1) != 1:
        raise ValueError(f"qweight {tuple(qweight.shape)} is not the contiguous plane layout of K = {k}")
    if group_size <= 0 or (group_size % PLANE and group_size < k):  # a 32-input plane lies in one group
        raise ValueError(f"group_size must be a multiple of {PLANE} or cover all {k} inputs, got {group_size}")
    groups = -(-k // group_size)
    if scales.shape != (groups, n) or not scales.is_contiguous():
        raise ValueError(f"scales must be contiguous ({groups}, {n}), got {tuple(scales.shape)}")
    if zeros is not None and (zeros.shape != (groups, n) or not zeros.is_contiguous()):
        raise ValueError(f"zeros must be contiguous ({groups}, {n}), got {tuple(zeros.shape)}")
    if x.is_cuda and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"w4a16 runs bf16 or fp16 activations on the GPU, got {x.dtype}")


def w4a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, bias: torch.Tensor | None = None, *, config: W4Config | None = None,
               locks: torch.Tensor | None = None) -> torch.Tensor:
    """x (M <= 16, K) -> (M, N). A split-K config needs `locks`: int32 zeros on x's device, at least
    `gemv_lock_count`, used by no other call at the same time (layers own one buffer each); None: fresh ones."""
    _check(x, qweight, scales, zeros, group_size)
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    if not 0 < m <= _ROWS:
        raise ValueError(f"w4a16_gemv takes 1..{_ROWS} rows, got {m}")
    x = x if x.stride(1) == 1 else x.contiguous()
    cfg = config or gemv_config(n, k)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    k_per_split, split, part, locks = split_k_buffers(out, k, _ROWS, BLOCK_K, cfg.split_k, gemv_lock_count(n, cfg),
                                                      locks)
    per_split = k_per_split // BLOCK_K  # the kernel counts a split in blocks of BLOCK_K inputs
    _w4a16_gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
        part, locks, m, n, k, scales.shape[0], per_split, split,
        x.stride(0), qweight.stride(0), out.stride(0),
        GROUP=group_size, ROWS=_ROWS, BLOCK_N=cfg.block_n, HAS_ZERO=zeros is not None, ZERO=SYMMETRIC_ZERO,
        HAS_BIAS=bias is not None, SPLIT=split > 1, EVEN_K=k % BLOCK_K == 0, SWAP=cfg.swap,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               group_size: int, bias: torch.Tensor | None = None, *,
               config: W4Config | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) for any M (prefill). From DEQUANTIZE_MIN_ROWS rows the weight is dequantized to x's
    dtype first (one pass writing N * K half floats) for cuBLAS, whose bf16 GEMM outruns the fused one there."""
    _check(x, qweight, scales, zeros, group_size)
    m, n, k = x.shape[0], qweight.shape[0], x.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    if config is None and m >= DEQUANTIZE_MIN_ROWS and x.is_cuda:
        return F.linear(x, w4a16_dequantize_triton(qweight, scales, zeros, group_size, k, x.dtype), bias)
    cfg = config or gemm_config(m, n)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    _w4a16_gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
        x, qweight, scales, zeros if zeros is not None else scales, bias if bias is not None else scales, out,
        m, n, k, scales.shape[0], x.stride(0), qweight.stride(0), out.stride(0),
        GROUP=group_size, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HAS_ZERO=zeros is not None,
        ZERO=SYMMETRIC_ZERO, HAS_BIAS=bias is not None, EVEN_K=k % BLOCK_K == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def w4a16_dequantize_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                            group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The (N, k) weight in `dtype`, as int4_layout.w4a16_dequantize computes it, in one launch."""
    n = qweight.shape[0]
    out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    if n and k:
        _w4_dequantize_kernel[(triton.cdiv(n, 64), triton.cdiv(k, BLOCK_K))](
            qweight, scales, zeros if zeros is not None else scales, out, n, k, scales.shape[0], qweight.stride(0),
            out.stride(0), GROUP=group_size, BLOCK_N=64, HAS_ZERO=zeros is not None, ZERO=SYMMETRIC_ZERO)
    return out
