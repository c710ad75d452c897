"""Triton pieces shared by the paged attention kernels (paged_decode, paged_prefill): the online softmax's start
and the K/V tile loads, FP8 steps behind a constexpr."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_start(scale_log2, k_scale_ptr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr):
    """(scale_log2, m_i, l_i, acc) before the first key tile: the score scale (an FP8 cache's k_scale folded in,
    so its keys are multiplied unscaled), and for ROWS query rows the running max -inf, sum 0 and output 0."""
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    return scale_log2, m_i, l_i, acc


@triton.jit
def load_kv_tile(ptrs, mask, dtype: tl.constexpr, MASKED: tl.constexpr, KV_FP8: tl.constexpr):
    """A K or V tile (zeros outside `mask` when MASKED; else every element is read), an FP8 cache's converted to
    `dtype` (exact: every e4m3 value is a bf16, fp16 and fp32 value; its scale is applied outside)."""
    if MASKED:
        tile = tl.load(ptrs, mask=mask, other=0.0)
    else:
        tile = tl.load(ptrs)
    if KV_FP8:
        tile = tile.to(dtype)
    return tile
