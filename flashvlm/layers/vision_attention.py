"""Bidirectional attention over variable-length segments (images, or windows of an image).

Segments are padded into one batch so a single SDPA call covers them all, instead of a loop per segment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     scale: float | None = None) -> torch.Tensor:
    """q, k, v: (tokens, heads, dim); cu_seqlens: host list of segment boundaries -> (tokens, heads, dim)."""
    lens = [b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
    starts = [a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) if b > a]
    if len(lens) == 1:
        # 4-D (batch, heads, len, dim): 3-D inputs make SDPA fall back to its quadratic-memory math kernel.
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], scale=scale)
        return o[0].transpose(0, 1)
    num_segs, max_len = len(lens), max(lens)
    device = q.device
    seg_of_token = torch.repeat_interleave(torch.arange(num_segs, device=device),
                                           torch.tensor(lens, device=device))
    starts_t = torch.tensor(starts, device=device)
    pos_in_seg = torch.arange(q.shape[0], device=device) - starts_t[seg_of_token]
    flat_index = seg_of_token * max_len + pos_in_seg

    def pad(x: torch.Tensor) -> torch.Tensor:
        buf = x.new_zeros(num_segs * max_len, *x.shape[1:])
        buf[flat_index] = x
        return buf.view(num_segs, max_len, *x.shape[1:]).transpose(1, 2)  # (segs, heads, len, dim)

    valid = torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    mask = valid[:, None, None, :]
    o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask, scale=scale)
    return o.transpose(1, 2).reshape(num_segs * max_len, *q.shape[1:])[flat_index]
