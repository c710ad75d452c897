"""Varlen prefill / extend attention over the paged KV cache (chunks of any length, decode tokens included).

Algorithm: sequence i has q_len new tokens after ctx = seq_len - q_len cached ones, and all seq_len keys are
already in the cache (write_kv runs first). Query j (position ctx + j) sees keys 0..ctx + j: full over the
cached prefix, causal inside the chunk. Flash-attention loop over BLOCK_N keys gathered page by page through
block_tables, online softmax in fp32 with exp2; only the key tiles on the causal diagonal are masked.
Grid: (num_tokens // BLOCK_Q + num_seqs, num_kv_heads). A tile packs BLOCK_Q tokens x GROUP query heads of
one KV head into BLOCK_M = BLOCK_Q * GROUP (+ pad) rows, so K/V are read once per GQA group and a decode
token costs one small tile, not a padded 64-row one. Sequence i owns tiles starting at
query_start_loc[i] // BLOCK_Q + i (an upper bound on the tiles before it); a program finds its sequence by
binary search over query_start_loc and exits if it lies past the sequence's last tile.
FP8 (e4m3) cache: as in paged_decode, K/V tiles are converted to q's dtype in registers, k_scale folds into the
score scale and v_scale multiplies the output, behind a constexpr (a cache in the model's dtype compiles the same
kernel without FP8 code); the scales are 1-element tensors read in the kernel.
Limits: last dims contiguous; sequences with q_len 0 are allowed (no tiles); device tensors plus the host
ints num_tokens, num_seqs and max_query_len (tile size choice), so the launch is graph-safe for fixed shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.kernels.paged_args import (
    check_key_bias,
    check_kv_scales,
    context_slots,
    gqa_group,
    last_dim_contiguous,
    read_context,
)
from flashvlm.kernels.paged_tiles import load_kv_tile, softmax_start

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(q, m_i, l_i, acc, k_ptr, v_ptr, table, head_off, pos, kv_end, q_pos, offs_d, d_mask, scale_log2,
                 stride_kb, stride_kt, bias_ptr, bias_coef, PAGE: tl.constexpr, CAUSAL: tl.constexpr,
                 EVEN_D: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr, HAS_BIAS: tl.constexpr):
    """One key tile of the online softmax, gathered page by page; CAUSAL tiles mask by position (and kv_end),
    the others are wholly visible. Returns the updated (m_i, l_i, acc)."""
    valid = pos < kv_end
    if CAUSAL:
        page = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
    else:
        page = tl.load(table + pos // PAGE).to(tl.int64)
    kv_ptrs = (page * stride_kb + (pos % PAGE) * stride_kt + head_off)[:, None] + offs_d[None, :]
    kv_mask = valid[:, None] & d_mask[None, :]
    k = load_kv_tile(k_ptr + kv_ptrs, kv_mask, q.dtype, CAUSAL or not EVEN_D, KV_FP8)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if HAS_BIAS:  # the slot's natural-log bias, in the unscaled score's units: scaling below makes it b * log2(e)
        bias = tl.load(bias_ptr + page * PAGE + pos % PAGE, mask=valid, other=0.0)
        s = s + bias[None, :] * bias_coef
    if CAUSAL:
        s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    # Scale after the row max: one fused multiply-add per score.
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = load_kv_tile(v_ptr + kv_ptrs, kv_mask, q.dtype, CAUSAL or not EVEN_D, KV_FP8)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, seq_lens_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr, bias_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # Largest i with query_start_loc[i] // BLOCK_Q + i <= pid; log2(num_seqs) scalar loads.
    lo = pid * 0
    hi = pid * 0 + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        go_right = first_tile <= pid
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    seq = lo - 1

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + seq)
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        tok = tile * BLOCK_Q + offs_m // GROUP
        heads = kvh * GROUP + offs_m % GROUP
        row_valid = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
        d_mask = offs_d < HEAD_DIM
        rows = (q_start + tok).to(tl.int64)
        q_pos = ctx + tok

        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        scale_log2, m_i, l_i, acc = softmax_start(scale_log2, k_scale_ptr, BLOCK_M, BLOCK_D, KV_FP8)
        bias_coef = 1.4426950408889634 / scale_log2
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        head_off = kvh.to(tl.int64) * stride_kh
        # Keys past the tile's last query are invisible to all of its rows; keys up to its first query's position
        # are visible to all of them, so whole key tiles below that need no causal mask. free_end is rounded down
        # to a tile, so the first diagonal tile starts at or before every row's position.
        kv_end = ctx + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)
        free_end = ((ctx + tile * BLOCK_Q) // BLOCK_N) * BLOCK_N
        # The diagonal tiles go first, so each row's max is finite from the start (padding rows included).
        for t in range(free_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_ptr, v_ptr, table, head_off, t + offs_n, kv_end, q_pos,
                                         offs_d, d_mask, scale_log2, stride_kb, stride_kt, bias_ptr, bias_coef, PAGE,
                                         True, EVEN_D, DOT_PREC, KV_FP8, HAS_BIAS)
        for t in range(0, free_end, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, m_i, l_i, acc, k_ptr, v_ptr, table, head_off, t + offs_n, kv_end, q_pos,
                                         offs_d, d_mask, scale_log2, stride_kb, stride_kt, bias_ptr, bias_coef, PAGE,
                                         False, EVEN_D, DOT_PREC, KV_FP8, HAS_BIAS)

        if KV_FP8:
            acc = acc * tl.load(v_scale_ptr)
        o = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])


def prefill_tiles(max_query_len: int, group: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): rows sized to the longest chunk (decode-heavy batches get
    16-row tiles), capped at 64. On the H200 at Qwen2-VL-7B's shapes (bf16, one 1,038- or 2,370-token prompt)
    64 rows, 4 warps and 3 stages beat 128 rows by 8-15% (more tiles fill more SMs); fp32 keeps 2 stages, its
    tiles take twice the shared memory."""
    block_m = min(64, max(16, triton.next_power_of_2(max(1, max_query_len) * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_n = 32 if dtype == torch.float32 or block_m <= 32 else 64
    num_warps = 8 if block_m >= 128 else 4
    return block_m, block_n, num_warps, 3 if block_m >= 64 and dtype != torch.float32 else 2


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, scale: float, max_query_len: int, out: torch.Tensor | None = None,
                  block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """q: (N, heads, head_dim) flat batch; kv_cache: (2, num_blocks, block_size, kv_heads, head_dim);
    query_start_loc: (B+1,) int32; seq_lens: (B,) int32 (cached + new); block_tables: (B, max_blocks) int32.
    An FP8 cache needs k_scale and v_scale (1-element float32 tensors). key_bias: (num_blocks * block_size,)
    float32, a bias added to the (scaled) logit of the key in each cache slot."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = gqa_group(num_heads, kv_heads)
    kv_fp8 = check_kv_scales(kv_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    q = last_dim_contiguous(q, kv_cache, out, block_tables)
    auto_m, auto_n, auto_warps, auto_stages = prefill_tiles(max_query_len, group, q.dtype)
    block_m = block_m or auto_m
    if block_m < group:
        raise ValueError(f"block_m {block_m} smaller than the GQA group {group}")
    block_q = block_m // group
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_tokens // block_q + num_seqs, kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, k_scale, v_scale,
        seq_lens if key_bias is None else check_key_bias(key_bias, kv_cache),  # a placeholder pointer without one
        scale * _LOG2E, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        EVEN_D=head_dim == triton.next_power_of_2(head_dim), BLOCK_M=block_m,
        BLOCK_Q=block_q, BLOCK_N=block_n or auto_n, PAGE=page,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=kv_fp8, HAS_BIAS=key_bias is not None,
        num_warps=num_warps or auto_warps, num_stages=num_stages or auto_stages,
    )
    return out


def paged_prefill_reference(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch varlen attention in fp32 (host loop over sequences; tests only). An FP8 cache is read as
    x.float() * scale; key_bias is added to the scaled scores by slot."""
    num_heads = q.shape[1]
    page, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        blocks = block_tables[i, : (seq_len + page - 1) // page].long()
        k, v = read_context(kv_cache, blocks, seq_len, k_scale, v_scale)
        k, v = k.repeat_interleave(num_heads // kv_heads, dim=1), v.repeat_interleave(num_heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if key_bias is not None:
            scores = scores + key_bias[context_slots(blocks, page, seq_len)].float()[None, None, :]
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out
