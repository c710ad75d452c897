"""Split-K flash-decoding over the paged KV cache: one new query token per sequence.

Algorithm: each sequence's context is cut into num_splits equal spans (a multiple of BLOCK_N tokens, sized
per sequence inside the kernel from seq_lens, so any num_splits is correct for any batch). A program
streams its span through online softmax in fp32 and writes a normalized partial output plus its log2
sum-exp; a second kernel merges the splits. With num_splits == 1 the first kernel writes the output directly.
Grid: stage 1 (num_seqs, num_kv_heads, num_splits); each program serves every query head of one KV head
group (GQA), padded to BLOCK_H >= 16 rows so QK^T and PV are tensor-core dots, and loads each K/V tile once.
Stage 2 (num_seqs, num_heads). Tokens are gathered page by page through block_tables, so BLOCK_N is
independent of the cache block size, and seq_len needs no alignment. seq_len 0 (padding rows) yields zeros.
FP8 (e4m3) cache: each K/V tile is converted to q's dtype in registers (exact: every e4m3 value is a bf16, fp16
and fp32 value) and the per-layer scales are applied once rather than per element: k_scale folds into the score
scale, v_scale multiplies the normalized output, so the result is softmax(q (K8 k_scale)^T scale) (V8 v_scale) as
the reference computes it. The scales are 1-element tensors read in the kernel (CUDA-graph safe); the FP8 steps
sit behind a constexpr, so a cache in the model's dtype compiles no FP8 code.
Limits: q row i belongs to sequence i (pure-decode batch); last dims contiguous; device tensors only and a
grid fixed by (num_seqs, num_splits), so launches can be captured in CUDA graphs.
"""

from __future__ import annotations

import math

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
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, bias_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_os, stride_oh, stride_ok,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h
    seq64 = seq.to(tl.int64)

    q = tl.load(q_ptr + seq64 * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    scale_log2, m_i, l_i, acc = softmax_start(scale_log2, k_scale_ptr, BLOCK_H, BLOCK_D, KV_FP8)
    table = block_tables_ptr + seq64 * stride_bt
    head_off = kvh.to(tl.int64) * stride_kh

    # Every iteration holds >= 1 valid key, so m_i is finite after the first one and exp2 never sees inf - inf.
    for t in range(start, end, BLOCK_N):
        pos = t + offs_n
        valid = pos < end
        page = tl.load(table + pos // PAGE, mask=valid, other=0).to(tl.int64)
        kv_off = page * stride_kb + (pos % PAGE) * stride_kt + head_off
        kv_ptrs = kv_off[:, None] + offs_d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = load_kv_tile(k_ptr + kv_ptrs, kv_mask, q.dtype, True, KV_FP8)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
        if HAS_BIAS:  # a natural-log bias on each key's logit, by cache slot
            bias = tl.load(bias_ptr + page * PAGE + pos % PAGE, mask=valid, other=0.0)
            s = s + bias[None, :] * 1.4426950408889634
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_kv_tile(v_ptr + kv_ptrs, kv_mask, q.dtype, True, KV_FP8)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    nonempty = l_i > 0
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr)
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(out_ptr + seq64 * stride_os + heads[:, None] * stride_oh + split * stride_ok + offs_d[None, :],
                 o, mask=out_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq64 * stride_ls + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    part_ptr, lse_ptr, out_ptr, num_splits,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + seq * stride_ls + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    # All splits empty (seq_len 0): weights become 0 and the output 0 instead of NaN.
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    denom = tl.sum(w, 0)
    parts = tl.load(part_ptr + seq * stride_ps + head * stride_ph + offs_s[:, None] * stride_pk + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int = 132,
                      min_tokens_per_split: int = 128, max_splits: int = 64) -> int:
    """Enough (seq, kv head, split) programs to fill ~2 waves of SMs, without splits shorter than
    min_tokens_per_split tokens of max_seq_len. Host ints only; a bound such as max_model_len keeps it static."""
    programs = max(1, num_seqs * num_kv_heads)
    by_occupancy = math.ceil(2 * num_sms / programs)
    by_length = math.ceil(max(1, max_seq_len) / min_tokens_per_split)
    return max(1, min(by_occupancy, by_length, max_splits))


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, num_splits: int = 1, out: torch.Tensor | None = None, block_n: int | None = None,
                 num_warps: int = 4, num_stages: int = 2, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, heads, head_dim), one token per sequence; kv_cache: (2, num_blocks, block_size, kv_heads, head_dim);
    block_tables: (B, max_blocks) int32; seq_lens: (B,) int32 (context length including this token). An FP8 cache
    needs k_scale and v_scale (1-element float32 tensors). key_bias: (num_blocks * block_size,) float32, a bias
    added to the (scaled) logit of the key in each cache slot."""
    num_seqs, num_heads, head_dim = q.shape
    kv_heads, page = kv_cache.shape[3], kv_cache.shape[2]
    group = gqa_group(num_heads, kv_heads)
    kv_fp8 = check_kv_scales(kv_cache, k_scale, v_scale)
    if seq_lens.shape[0] != num_seqs or block_tables.shape[0] != num_seqs:
        raise ValueError("paged_decode expects exactly one query token per sequence")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    q = last_dim_contiguous(q, kv_cache, out, block_tables)
    block_h = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    if block_n is None:
        block_n = 32 if q.dtype == torch.float32 else 64
    if block_n < 16:
        raise ValueError(f"block_n must be >= 16 (tl.dot needs K >= 16 on GPUs), got {block_n}")
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    scale_log2 = scale * _LOG2E
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=block_n, PAGE=page,
                  DOT_PREC=dot_prec, KV_FP8=kv_fp8, HAS_BIAS=key_bias is not None, num_warps=num_warps,
                  num_stages=num_stages)
    bias = seq_lens if key_bias is None else check_key_bias(key_bias, kv_cache)  # a placeholder pointer
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    if num_splits <= 1:
        _decode_split_kernel[(num_seqs, kv_heads, 1)](
            q, k_cache, v_cache, block_tables, seq_lens, out, out, k_scale, v_scale, bias, scale_log2,
            q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0, DIRECT=True, **common)
        return out
    part = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part, lse, k_scale, v_scale, bias, scale_log2,
        q.stride(0), q.stride(1), *kv_strides, block_tables.stride(0),
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1), DIRECT=False, **common)
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(num_splits), num_warps=4)
    return out


def paged_decode_reference(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, key_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch decode attention in fp32 (host loop over sequences; tests only). seq_len 0 gives zeros. An FP8
    cache is read as x.float() * scale; key_bias is added to the scaled scores by slot."""
    num_seqs, num_heads, _ = q.shape
    page, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        blocks = block_tables[i, : (seq_len + page - 1) // page].long()
        k, v = read_context(kv_cache, blocks, seq_len, k_scale, v_scale)
        k, v = k.repeat_interleave(num_heads // kv_heads, dim=1), v.repeat_interleave(num_heads // kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", q[i].float(), k) * scale
        if key_bias is not None:
            scores = scores + key_bias[context_slots(blocks, page, seq_len)].float()[None, :]
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
