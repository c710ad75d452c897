"""The per-row amax pass a quantized GEMV runs before its weights, when it quantizes its activations itself.

Each program of the FP8 and INT8 GEMVs needs the amax of every x row over the whole K before its first
product. x is small (7-37 KB a row at Qwen2-7B's shapes) and stays in L2, but a pass of many narrow dependent
loads would stall every program for microseconds. So the pass loads (PRO_ROWS, PRO_K) tiles, PRO_ROWS the rows
rounded up to a power of two (one row's pass takes a few wide loads, not many mostly masked 16-row ones), and
issues UNROLL of them at a time.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashvlm.kernels.dispatch import next_power_of_2

__all__ = ["PROLOGUE_UNROLL", "prologue_shape", "quantize_warps", "row_amax"]

_PROLOGUE_ELEMENTS = 4096  # x elements of one load of the pass
PROLOGUE_UNROLL = 4  # such loads in flight at once


def prologue_shape(m: int, k: int) -> tuple[int, int]:
    """(PRO_ROWS, PRO_K) of the pass over m rows of k inputs."""
    pro_rows = next_power_of_2(m)
    return pro_rows, min(_PROLOGUE_ELEMENTS // pro_rows, next_power_of_2(k))


@triton.jit
def row_amax(x_ptr, M, K, x_stride, ROWS: tl.constexpr, PRO_ROWS: tl.constexpr, PRO_K: tl.constexpr,
             UNROLL: tl.constexpr):
    """max |x[m, :]| in float32 as a (ROWS,) vector: 0 for the rows past M (ROWS >= PRO_ROWS >= M)."""
    prow = tl.arange(0, PRO_ROWS)
    amax = tl.zeros((PRO_ROWS, PRO_K), dtype=tl.float32)
    for k0 in range(0, K, PRO_K * UNROLL):
        for u in tl.static_range(UNROLL):
            ks = k0 + u * PRO_K + tl.arange(0, PRO_K)
            t = tl.load(x_ptr + prow[:, None] * x_stride + ks[None, :],
                        mask=(prow < M)[:, None] & (ks < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.abs(t.to(tl.float32)))
    per_row = tl.max(amax, axis=1)
    rows = tl.arange(0, ROWS)
    return tl.max(tl.where(rows[:, None] == prow[None, :], per_row[None, :], 0.0), axis=1)


def quantize_warps(block: int) -> int:
    """Warps of a one-row-per-program quantization launch whose loads are `block` elements wide: enough that a
    whole row of up to 32,768 inputs sits in registers (at most 64 values a thread)."""
    return 4 if block < 4096 else 8 if block < 16384 else 16
