"""Greedy tokens of rows under a structured-output mask and the min_tokens ban, in one pass over the logits.

The sampler's torch path for such a greedy row (runner/sampler.py: `apply_penalties`, then argmax) launches about
a dozen kernels over the whole (rows, vocab) logits: a float32 copy, the bitmask unpacked to booleans, a masked
fill, the ban of the stop tokens and the fallback for a row the ban would leave empty. Here one program per row
reads each logit once and keeps two first maxima: over the allowed tokens with the banned ones removed (the
answer), and over the allowed tokens alone (the answer when the ban leaves no token: a complete constraint allows
only stop tokens, and min_tokens yields to it, as in the sampler). The logits are finite (a model's output).
Reference: `masked_greedy_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashvlm.runner.token_mask import unpack_bitmask

_BLOCK = 2048


@triton.jit
def _keep_first_max(x, offs, best, best_i):
    """Per lane, the largest value so far and the first index that had it (strictly larger values replace it)."""
    take = x > best
    return tl.where(take, x, best), tl.where(take, offs, best_i)


@triton.jit
def _first_argmax(best, best_i):
    """The first index of the row's largest value, from the lanes' (value, first index); 0 for an all -inf row."""
    m = tl.max(best, axis=0)
    return tl.min(tl.where(best == m, best_i, 2147483647), axis=0), m


@triton.jit
def _masked_greedy_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, mask_rows_ptr, banned_ptr,
                          banned_stride, out_ptr, vocab, n_words,
                          NUM_BANNED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    mask_row = tl.load(mask_rows_ptr + row).to(tl.int64)
    constrained = mask_row >= 0
    words_row = bitmask_ptr + tl.maximum(mask_row, 0) * bitmask_stride
    words_limit = tl.where(constrained, n_words, 0)
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)  # with the ban
    best_i = tl.zeros([BLOCK], tl.int32)
    kept = tl.full([BLOCK], float("-inf"), tl.float32)  # without it
    kept_i = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        offs = start + lanes
        inside = offs < vocab
        x = tl.load(logits_ptr + row * logits_stride + offs, mask=inside, other=float("-inf")).to(tl.float32)
        word_index = offs // 32
        # An unconstrained row reads no words (every bit set); a constrained one allows nothing past its words.
        words = tl.load(words_row + word_index, mask=inside & (word_index < words_limit), other=0)
        words = tl.where(constrained, words, -1)
        x = tl.where(inside & (((words >> (offs % 32)) & 1) != 0), x, float("-inf"))
        kept, kept_i = _keep_first_max(x, offs, kept, kept_i)
        for k in tl.static_range(NUM_BANNED):
            token = tl.load(banned_ptr + row * banned_stride + k)
            x = tl.where(offs == token, float("-inf"), x)
        best, best_i = _keep_first_max(x, offs, best, best_i)
    answer, top = _first_argmax(best, best_i)
    fallback, _ = _first_argmax(kept, kept_i)
    tl.store(out_ptr + row, tl.where(top > float("-inf"), answer, fallback).to(tl.int64))


def masked_greedy_triton(logits: torch.Tensor, bitmask: torch.Tensor | None, mask_rows: torch.Tensor,
                         banned: torch.Tensor) -> torch.Tensor:
    """(B,) int64 greedy tokens of `logits` (B, V).

    bitmask: (R, W) int32 on the logits' device, bit t % 32 of word t // 32 set = token t allowed (tokens past
    32 * W disallowed), or None when no row is constrained; mask_rows: (B,) int32, the bitmask row of each logits
    row, -1 for an unconstrained row; banned: (B, S) int64, each row's banned token ids padded with -1 (S may be
    0)."""
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if bitmask is None:  # no row is constrained; the kernel still needs a pointer
        bitmask = torch.zeros((1, 1), dtype=torch.int32, device=logits.device)
    num_banned = banned.shape[1]
    if num_banned == 0:
        banned = torch.full((num_rows, 1), -1, dtype=torch.int64, device=logits.device)
    _masked_greedy_kernel[(num_rows,)](
        logits, logits.stride(0), bitmask, bitmask.stride(0), mask_rows, banned, banned.stride(0), out,
        vocab, bitmask.shape[1], NUM_BANNED=num_banned, BLOCK=_BLOCK, num_warps=8)
    return out


def masked_greedy_reference(logits: torch.Tensor, bitmask: torch.Tensor, mask_rows: torch.Tensor,
                            banned: torch.Tensor) -> torch.Tensor:
    """The same in plain torch (the arguments of `masked_greedy_triton`)."""
    x = logits.float()
    rows = torch.nonzero(mask_rows >= 0).view(-1)
    if rows.numel():
        allowed = unpack_bitmask(bitmask[mask_rows[rows].long()], x.shape[1])
        x[rows] = x[rows].masked_fill(~allowed, float("-inf"))
    y = x.clone()
    for r, c in torch.nonzero((banned >= 0) & (banned < x.shape[1])).tolist():
        y[r, banned[r, c]] = float("-inf")
    return torch.where(torch.isfinite(y).any(dim=-1), y.argmax(dim=-1), x.argmax(dim=-1))
