"""Bidirectional attention over variable-length segments (images, or windows of an image).

Segments of equal length (Qwen2.5-VL's windows, same-size images) form one dense batch with no mask, which
lets SDPA use its flash kernel; each group of lengths is one SDPA call. The gather/scatter indices depend only
on the host-side segment boundaries, so they are built once with numpy and cached: a vision tower calls this
with the same boundaries in every block, and no call syncs the device. With impl="fa4" (engine option
`vision_attention`), FlashAttention-4's varlen kernel takes the packed tokens and the boundaries as they are.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F

from flashvlm.kernels.dispatch import fa4_takes


@functools.lru_cache(maxsize=64)
def _groups(cu_seqlens: tuple[int, ...]) -> tuple[tuple[int, np.ndarray], ...]:
    """(segment length, token indices (segments, length)) for each distinct segment length."""
    starts = np.asarray(cu_seqlens[:-1], dtype=np.int64)
    lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    out = []
    for length in sorted(set(lens.tolist()) - {0}):
        seg_starts = starts[lens == length]
        out.append((int(length), seg_starts[:, None] + np.arange(length, dtype=np.int64)[None, :]))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _device_groups(cu_seqlens: tuple[int, ...], device: torch.device) -> tuple[tuple[int, torch.Tensor], ...]:
    return tuple((length, torch.from_numpy(idx).to(device, non_blocking=True)) for length, idx in _groups(cu_seqlens))


@functools.lru_cache(maxsize=64)
def _device_boundaries(cu_seqlens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, int]:
    """(boundaries as int32 on the device, longest segment) for FlashAttention-4's varlen call."""
    longest = max((b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])), default=0)
    return torch.tensor(cu_seqlens, dtype=torch.int32).to(device, non_blocking=True), longest


_recorders: list[list] = []


@contextlib.contextmanager
def keep_index_tensors() -> Iterator[list]:
    """Collect the gather/scatter index tensors varlen_attention uses inside the block. A CUDA graph captured
    there reads them by address on every replay without calling this module, so whoever keeps the graph must
    keep them: the LRU cache alone would free them once 64 other segment layouts have been seen."""
    used: list = []
    _recorders.append(used)
    try:
        yield used
    finally:
        _recorders.remove(used)


def _keep_for_graphs(tensors: tuple) -> tuple:
    """Hand the device tensors a call reads to every open keep_index_tensors() block; returns them."""
    for used in _recorders:
        if not used or used[-1] is not tensors:  # every block of a tower passes the same ones
            used.append(tensors)
    return tensors


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     scale: float | None = None, impl: str = "sdpa") -> torch.Tensor:
    """q, k, v: (tokens, heads, dim); cu_seqlens: host list of segment boundaries -> (tokens, heads, dim).
    impl: "sdpa" (torch's fused kernels) or "fa4" (FlashAttention-4's varlen kernel on CUDA tensors: no
    padding of the head dim, no gather for segments of mixed lengths)."""
    bounds = tuple(int(c) for c in cu_seqlens)
    # FA4 where it takes the inputs (CUDA, bf16/fp16, its head dims); otherwise torch's kernels, as for "sdpa".
    if impl == "fa4" and fa4_takes(q) and bounds and bounds[0] == 0 and bounds[-1] == q.shape[0]:
        from flashvlm.attention.flash_attn4 import varlen_self_attention

        boundaries = _keep_for_graphs(_device_boundaries(bounds, q.device))
        return varlen_self_attention(q, k, v, boundaries[0], boundaries[1], scale)
    groups = _keep_for_graphs(_device_groups(bounds, q.device))
    if len(groups) == 1 and groups[0][1].numel() == q.shape[0] and cu_seqlens[0] == 0:
        # Equal segments covering every token in order (one image, same-size images, empty segments aside):
        # a view as (segments, heads, len, dim), no gather and no scatter (8 ms of a 320 ms step on the H200
        # with 8 images of 1008x756).
        segments, length = groups[0][1].shape

        def dense(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(0, (segments, length)).transpose(1, 2)

        o = F.scaled_dot_product_attention(dense(q), dense(k), dense(v), scale=scale)
        return o.transpose(1, 2).flatten(0, 1)
    out = torch.empty_like(q)
    for _, idx in groups:
        flat = idx.reshape(-1)

        def batch(x: torch.Tensor, idx=idx, flat=flat) -> torch.Tensor:
            # (segments, length, heads, dim) -> (segments, heads, length, dim)
            return x.index_select(0, flat).view(*idx.shape, *x.shape[1:]).transpose(1, 2)

        o = F.scaled_dot_product_attention(batch(q), batch(k), batch(v), scale=scale)
        out.index_copy_(0, flat, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out
