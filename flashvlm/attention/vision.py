"""Vision-tower attention backends: bidirectional attention over variable-length segments (images, or windows
of an image), registered by name (EngineConfig.vision_attention's values).

"sdpa": segments of equal length (Qwen2.5-VL's windows, same-size images) form one dense batch with no mask,
which lets SDPA use its flash kernel; each group of lengths is one SDPA call. The gather/scatter indices depend
only on the host-side segment boundaries, so they are built once with numpy and cached: a vision tower calls
this with the same boundaries in every block, and no call syncs the device.
"fa4": FlashAttention-4's varlen kernel takes the packed tokens and the boundaries as they are (no padding of the
head dim, no gather for segments of mixed lengths), where it takes the inputs; elsewhere "sdpa".
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
    """Collect the gather/scatter index tensors the vision backends use inside the block. A CUDA graph captured
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


class SdpaVisionAttention:
    """torch's fused SDPA kernels, one call per group of equal segment lengths."""

    name = "sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...],
                scale: float | None) -> torch.Tensor:
        """q, k, v: (tokens, heads, dim); bounds: host segment boundaries -> (tokens, heads, dim)."""
        groups = _keep_for_graphs(_device_groups(bounds, q.device))
        if len(groups) == 1 and groups[0][1].numel() == q.shape[0] and bounds[0] == 0:
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


class FA4VisionAttention(SdpaVisionAttention):
    """FlashAttention-4's varlen kernel where it takes the inputs (CUDA, bf16/fp16, its head dims, boundaries that
    tile the tokens from 0); torch's kernels otherwise, so a float32 model on an engine that chose FA4 still runs."""

    name = "fa4"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: tuple[int, ...],
                scale: float | None) -> torch.Tensor:
        if fa4_takes(q) and bounds and bounds[0] == 0 and bounds[-1] == q.shape[0]:
            from flashvlm.attention.flash_attn4 import varlen_self_attention

            boundaries = _keep_for_graphs(_device_boundaries(bounds, q.device))
            return varlen_self_attention(q, k, v, boundaries[0], boundaries[1], scale)
        return super().forward(q, k, v, bounds, scale)


VisionAttentionBackend = SdpaVisionAttention
"""The interface every vision backend has (name, forward); sdpa is the base the others fall back to."""

VISION_BACKENDS: dict[str, VisionAttentionBackend] = {b.name: b for b in (SdpaVisionAttention(), FA4VisionAttention())}
"""Vision attention backends by name; stateless, so one instance each serves every tower."""


def vision_backend(name: str) -> VisionAttentionBackend:
    if name not in VISION_BACKENDS:
        raise ValueError(f"unknown vision attention backend {name!r} (available: {', '.join(VISION_BACKENDS)})")
    return VISION_BACKENDS[name]


def set_vision_attention(model: torch.nn.Module, name: str) -> None:
    """Set every vision-tower layer of `model` that has a choice (an `attention_impl`) to the vision backend
    `name`; an unknown name raises before any layer changes."""
    vision_backend(name)
    for module in model.modules():
        if hasattr(module, "attention_impl"):
            module.attention_impl = name
