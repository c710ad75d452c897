"""Pillow's resize of a uint8 picture, bit for bit, as torch integer arithmetic on any device.

The HF processors resize with Pillow (`Image.resize`, bicubic for Qwen and CLIP), and parity with them needs the
same bytes. On the host that resize is most of an image's preprocessing (about 16 ms for 1008x756 -> 1024x768 on
the H200 host); on a GPU the same arithmetic is a few small launches.

Pillow's algorithm for 8-bit images: two passes, one per axis, each output sample a weighted sum of a window of
input samples. A window's weights are the filter at the input samples' distances from the output sample's centre
(in double precision, the filter widened by the scale when shrinking), normalised to sum to one, then rounded to
fixed point with 22 fractional bits. A pass adds half a unit, shifts right by 22 and clamps to 0..255, so the
first pass is rounded to uint8 before the second reads it, and which runs first matters: Pillow 13
(pyproject.toml's range) takes the height first when it shrinks by more than twice as many pixels as the width,
else the width; Pillow 12 and older always the width first (`_height_first` follows the installed one).

The weights are computed on the host with the same double operations in the same order (`_window_weights`); the
passes are integer sums, exact on every device (int32, wrapping as Pillow's C ints would). Only filters whose
weights need no transcendental functions are taken (bilinear, bicubic: `supports`).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import PIL
import torch
from PIL import Image

from flashvlm.runner.sampler import host_to_device

_PRECISION_BITS = 32 - 8 - 2
"""Fractional bits of the fixed-point weights (Pillow's: 8 bits of result, two of headroom for negative lobes)."""
_PILLOW_MAJOR = int(PIL.__version__.split(".")[0])
"""Pillow 13 changed which axis goes first; the passes follow the Pillow that resizes on the host."""


def _bilinear(x: np.ndarray) -> np.ndarray:
    ax = np.abs(x)
    return np.where(ax < 1.0, 1.0 - ax, 0.0)


def _bicubic(x: np.ndarray) -> np.ndarray:
    # Keys' cubic convolution with a = -0.5, each double operation in Pillow's order, so the same doubles.
    a = -0.5
    ax = np.abs(x)
    near = ((a + 2.0) * ax - (a + 3.0)) * ax * ax + 1
    far = (((ax - 5) * ax + 8) * ax - 4) * a
    return np.where(ax < 1.0, near, np.where(ax < 2.0, far, 0.0))


_FILTERS = {Image.Resampling.BILINEAR: (_bilinear, 1.0), Image.Resampling.BICUBIC: (_bicubic, 2.0)}
"""Pillow filter -> (kernel, support in input samples at scale 1)."""


def supports(resample: int) -> bool:
    """Whether `resize_like_pillow` reproduces this Pillow filter."""
    return resample in _FILTERS


def _window_weights(in_size: int, out_size: int, resample: int) -> tuple[np.ndarray, np.ndarray]:
    """(first input index (out_size,) int64, fixed-point weights (out_size, taps) int32, zero past each window's
    end) of one axis, as Pillow computes them for a whole-picture resize: elementwise double operations (no fused
    multiply-add, no pairwise sums) in the order of its C loop."""
    kernel, base_support = _FILTERS[resample]
    scale = float(in_size) / out_size
    filter_scale = max(scale, 1.0)
    support = base_support * filter_scale
    taps = math.ceil(support) * 2 + 1
    center = 0.0 + (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    lo = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    hi = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    offsets = np.arange(taps, dtype=np.int64)
    inside = offsets[None, :] < (hi - lo)[:, None]
    w = np.where(inside, kernel(((offsets[None, :] + lo[:, None]) - center[:, None] + 0.5) * (1.0 / filter_scale)),
                 0.0)
    total = np.zeros(out_size)
    for t in range(taps):  # one tap at a time, as the C loop adds them (adding the zeros past the end is exact)
        total = total + w[:, t]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    one = float(1 << _PRECISION_BITS)
    fixed = np.where(w < 0, np.trunc(-0.5 + w * one), np.trunc(0.5 + w * one)).astype(np.int32)
    return lo, fixed


@functools.lru_cache(maxsize=256)
def _axis_tables(in_size: int, out_size: int, resample: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input index, weight) per tap and output sample, (taps, out_size) each, on `device`: a picture size seen
    again (a product's screenshots, a video's frames) costs no host work and no copy."""
    starts, weights = _window_weights(in_size, out_size, resample)
    taps = weights.shape[1]
    # Window entries past an input's end carry weight 0; their index is clamped only so the gather stays inside.
    index = np.minimum(starts[:, None] + np.arange(taps)[None, :], in_size - 1)
    return (host_to_device(np.ascontiguousarray(index.T), torch.int64, device),
            host_to_device(np.ascontiguousarray(weights.T), torch.int32, device))


def _resample_axis(x: torch.Tensor, axis: int, out_size: int, resample: int) -> torch.Tensor:
    """One pass over `axis` (0: rows, 1: columns) of uint8 (H, W, C) -> uint8, Pillow's rounding and clamping."""
    index, weights = _axis_tables(x.shape[axis], out_size, resample, x.device)
    src = x.to(torch.int32)
    if axis == 1:
        src = src.transpose(0, 1)  # (W, H, C): a column pass is a row pass of the transpose
    acc = torch.full((out_size, *src.shape[1:]), 1 << (_PRECISION_BITS - 1), dtype=torch.int32, device=x.device)
    for t in range(index.shape[0]):
        acc += src.index_select(0, index[t]) * weights[t].view(out_size, 1, 1)
    out = torch.clamp(acc >> _PRECISION_BITS, 0, 255).to(torch.uint8)
    return out if axis == 0 else out.transpose(0, 1).contiguous()


def _height_first(height: int, width: int, out_height: int, out_width: int) -> bool:
    """Whether the installed Pillow resizes the height before the width for this change of size."""
    if _PILLOW_MAJOR < 13:
        return False
    shrink = height - out_height
    return shrink > 0 and shrink > (width - out_width) * 2


def resize_like_pillow(x: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    """uint8 (H, W, C) -> uint8 (height, width, C), equal to `Image.resize((width, height), resample)` of the same
    picture (a supported filter; `supports`), computed where `x` is."""
    if not supports(resample):
        raise ValueError(f"resize_like_pillow reproduces bilinear and bicubic, not Pillow filter {resample}")
    if x.dtype != torch.uint8 or x.dim() != 3:
        raise ValueError(f"resize_like_pillow takes uint8 (H, W, C), got {x.dtype} {tuple(x.shape)}")
    axes = [(1, width), (0, height)]
    if _height_first(x.shape[0], x.shape[1], height, width):
        axes.reverse()
    for axis, size in axes:
        if size != x.shape[axis]:
            x = _resample_axis(x, axis, size, resample)
    return x
