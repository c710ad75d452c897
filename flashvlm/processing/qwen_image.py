"""Qwen2-VL / Qwen2.5-VL images: smart-resize to multiples of patch * merge, patchify to flat rows (HF's
Qwen2VLImageProcessor, PIL backend; see `preprocess.py` for the order of operations), and the `MMItem`s they make:
the (t, h, w) patch grid is the item's layout, and the host keeps the resized uint8 image, which the runner
finishes on the GPU (`decode_compact`). For a GPU engine the host may keep the picture as it came instead, and
the runner resizes it there, bit for bit as Pillow does (`decode_source`, processing/device_resize.py)."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from flashvlm.processing.device_resize import resize_like_pillow, supports
from flashvlm.processing.hashing import hash_pixels
from flashvlm.processing.preprocess import (
    PixelSettings,
    SourceImage,
    check_image_shape,
    pixel_levels,
    positive_int,
    table_on,
    to_rgb,
    token_blocks,
)
from flashvlm.processing.qwen_grid import largest_qwen_grid, qwen_target_size
from flashvlm.pruning.base import TokenGrid
from flashvlm.request import InvalidRequestError, MMItem

if TYPE_CHECKING:
    from flashvlm.processing.pixel_cache import PixelCache

Grid = tuple[int, int, int]


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen's target (height, width): multiples of ``factor``, area within [min, max], aspect kept.

    Same arithmetic as HF, including Python's round-half-to-even in the first rounding.
    """
    check_image_shape(height, width)
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w



@dataclass
class QwenImageProcessor(PixelSettings):
    """Qwen2-VL / Qwen2.5-VL: smart-resize to multiples of patch*merge, patchify to flat rows."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_pixels_limit: int | None = None
    """Ceiling for per-request ``max_pixels``/``min_pixels``; None means the configured max_pixels.
    It stops a request from upscaling a tiny image to an arbitrarily large one."""

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> QwenImageProcessor:
        """Build from a ``preprocessor_config.json`` dict (old min/max_pixels or newer ``size`` form)."""
        size = d.get("size") or {}
        min_px = size.get("shortest_edge", size.get("min_pixels", cls.min_pixels))
        max_px = size.get("longest_edge", size.get("max_pixels", cls.max_pixels))
        # As in HF, top-level min_pixels/max_pixels win over ``size``.
        min_px = positive_int(d, "min_pixels", min_px)
        max_px = positive_int(d, "max_pixels", max_px)
        if min_px > max_px:
            raise ValueError(f"preprocessor config: min_pixels {min_px} > max_pixels {max_px}")
        return cls(
            patch_size=positive_int(d, "patch_size", cls.patch_size),
            temporal_patch_size=positive_int(d, "temporal_patch_size", cls.temporal_patch_size),
            merge_size=positive_int(d, "merge_size", cls.merge_size),
            min_pixels=min_px,
            max_pixels=max_px,
            **PixelSettings.settings_from_config(d),
        )

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resolve_pixels(self, min_pixels: int | None = None, max_pixels: int | None = None) -> tuple[int, int]:
        """Effective (min, max) pixels for a request; overrides are validated -> InvalidRequestError.

        Unlike HF (which silently ignores a lone min_pixels or max_pixels at call time), one
        override alone is honoured and combined with the configured other bound.
        """
        limit = self.max_pixels_limit if self.max_pixels_limit is not None else self.max_pixels
        for name, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidRequestError(f"{name} must be a positive integer, got {v!r}")
            if v > limit:
                raise InvalidRequestError(f"{name}={v} exceeds the server limit of {limit} pixels")
        lo = self.min_pixels if min_pixels is None else min_pixels
        hi = self.max_pixels if max_pixels is None else max_pixels
        if lo > hi:
            raise InvalidRequestError(f"min_pixels ({lo}) must be <= max_pixels ({hi})")
        return lo, hi

    def target_size(self, height: int, width: int, min_pixels: int | None = None,
                    max_pixels: int | None = None) -> tuple[int, int]:
        """(height, width) the image is resized to."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise InvalidRequestError(
                    f"image {width}x{height} must be a multiple of {self.factor} when do_resize is off"
                )
            return height, width
        lo, hi = self.resolve_pixels(min_pixels, max_pixels)
        return smart_resize(height, width, self.factor, lo, hi)

    def grid_thw(self, height: int, width: int, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> tuple[int, int, int]:
        """Grid in patches for an image of this size, without touching pixels (for token counting)."""
        h, w = self.target_size(height, width, min_pixels, max_pixels)
        return 1, h // self.patch_size, w // self.patch_size

    def num_image_tokens(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens = embeddings after the patch merger."""
        t, h, w = grid_thw
        return t * h * w // self.merge_size**2

    def preprocess(self, img: Image.Image, min_pixels: int | None = None, max_pixels: int | None = None,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """-> (pixel_values float32 (patches, C*T*P*P), grid_thw (1, h, w)) on `device`; one image repeated over
        T. The resized uint8 image crosses to the device and is finished there (`decode_compact`)."""
        compact, grid = self.preprocess_compact(img, min_pixels, max_pixels)
        return self.decode_compact(compact if device is None else compact.to(device)), grid

    def preprocess_compact(self, img: Image.Image, min_pixels: int | None = None,
                           max_pixels: int | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """The host path up to the resize: the resized image as uint8 (H, W, C), an eighth of the model-ready
        float bytes. `decode_compact` finishes it where it is used (on the GPU in the engine: patchify,
        normalize, temporal copy) into exactly what `preprocess` returns."""
        resized = self._resized(img, min_pixels, max_pixels)
        grid = (1, resized.height // self.patch_size, resized.width // self.patch_size)
        # np.array copies, so the tensor owns writable memory (torch wants that); one copy, no patchify here.
        return torch.from_numpy(np.array(resized, dtype=np.uint8, order="C")), grid

    def decode_compact(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (H, W, C) of `preprocess_compact` -> float32 (patches, C*T*P*P): patch order, then one table
        lookup (the normalization of each of the 256 values of each channel, computed like `preprocess.normalize`), then
        the temporal copy."""
        h, w, c = x.shape
        rows = self._patchify(x, h, w)  # (patches, C*P*P) uint8, a strided view until the lookup gathers it
        n, cols = rows.shape
        per_channel = cols // c
        offsets = torch.arange(0, 256 * c, 256, dtype=torch.int32, device=x.device).repeat_interleave(per_channel)
        values = torch.index_select(table_on(self, x.device), 0, (rows.to(torch.int32) + offsets).reshape(-1))
        t = self.temporal_patch_size
        return values.view(n, c, 1, per_channel).expand(n, c, t, per_channel).reshape(n, c * t * per_channel)

    def decode_source(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """uint8 (H, W, C) as the picture came -> what `preprocess` returns for it: resized to (height, width)
        where it is, as Pillow would (processing/device_resize.py), then `decode_compact`."""
        return self.decode_compact(resize_like_pillow(x, height, width, self.resample))

    def _resized(self, img: Image.Image, min_pixels: int | None, max_pixels: int | None) -> Image.Image:
        img = to_rgb(img)
        h, w = self.target_size(img.height, img.width, min_pixels, max_pixels)
        return img if (h, w) == (img.height, img.width) else img.resize((w, h), resample=self.resample)

    def _patchify(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(H, W, C) pixels -> rows ordered merge-window by merge-window (the patch merger folds m*m neighbours),
        each laid out as (C, P, P) (`decode_compact` inserts the temporal axis of the Conv3d patch embedding)."""
        p, m = self.patch_size, self.merge_size
        gh, gw = h // p, w // p
        c = x.shape[-1]
        x = x.reshape(gh // m, m, p, gw // m, m, p, c).permute(0, 3, 1, 4, 6, 2, 5)
        return x.reshape(gh * gw, c * p * p)

    def processor_params(self, min_pixels: int | None = None,
                         max_pixels: int | None = None) -> dict[str, Any]:
        """Everything that changes pixel_values, for the content hash (effective per-request bounds)."""
        lo, hi = self.resolve_pixels(min_pixels, max_pixels)
        return {
            "family": "qwen2_vl", "patch_size": self.patch_size,
            "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
            "min_pixels": lo, "max_pixels": hi,
            "image_mean": list(self.image_mean), "image_std": list(self.image_std),
            "rescale_factor": self.rescale_factor, "do_resize": self.do_resize,
            "do_rescale": self.do_rescale, "do_normalize": self.do_normalize, "resample": self.resample,
        }


@dataclass
class QwenImageInputs:
    """Qwen's `preprocess.ImageInputs`: items whose layout is the (t, h, w) patch grid."""

    processor: QwenImageProcessor
    resize_where_decoded: bool = False
    """Leave a picture's resize to the device that finishes its pixels (the engine's GPU: a few launches there
    against ~16 ms of Pillow on the host for 1008x756 -> 1024x768), where the filter allows (`device_resize.supports`)
    and the picture has at most MAX_DEFERRED_SCALE times the resized one's pixels (a larger one crosses to the
    device resized, smaller)."""

    MAX_DEFERRED_SCALE = 2

    def make_item(self, image: SourceImage, kwargs: dict, cache: PixelCache, device: str | None) -> MMItem:
        mm_hash, pixels, grid, worth_keeping = self._pixels(image, kwargs, cache, device)
        if worth_keeping:
            cache.put(mm_hash, pixels, grid)
        decoder = None
        if pixels.dtype == torch.uint8:
            size = self._grid_size(grid)
            decoder = (self.processor.decode_compact if tuple(pixels.shape[:2]) == size
                       else functools.partial(self.processor.decode_source, height=size[0], width=size[1]))
        return MMItem(mm_hash=mm_hash, pixel_values=pixels, num_tokens=self.processor.num_image_tokens(grid),
                      layout=grid, image_size=image.size, pixel_decoder=decoder)

    def profile_item(self) -> MMItem:
        """The largest image a request may send (see `largest_qwen_grid`), as zero float pixels."""
        proc = self.processor
        grid = largest_qwen_grid(proc)
        patch = 3 * proc.temporal_patch_size * proc.patch_size ** 2
        pixels = torch.zeros(grid[0] * grid[1] * grid[2], patch)
        return MMItem(mm_hash="memory-profile", pixel_values=pixels, num_tokens=proc.num_image_tokens(grid),
                      layout=grid)

    def _grid_size(self, grid: Sequence[int]) -> tuple[int, int]:
        """(height, width) of the resized picture of a (t, h, w) patch grid."""
        return grid[1] * self.processor.patch_size, grid[2] * self.processor.patch_size

    def token_grid(self, item: MMItem) -> TokenGrid:
        """The (t, h, w) patch grid divided by the merge size: the patch merger folds each merge x merge window
        into one token, and the windows come in raster order (`_patchify`)."""
        return TokenGrid.from_patch_grid(item.layout, self.processor.merge_size)

    def token_pixels(self, item: MMItem) -> torch.Tensor:
        """(tokens, F) uint8: the resized image's levels in each merged token's (patch * merge)^2 block, from the
        compact image or from the model-ready rows (whose merge^2 rows a token are consecutive, `_patchify`)."""
        proc, pixels = self.processor, item.pixel_values
        if pixels.dtype == torch.uint8:
            size = self._grid_size(item.layout)
            if tuple(pixels.shape[:2]) != size:  # the picture as it came: resized here as the device would
                resized = Image.fromarray(pixels.numpy()).resize(size[::-1], resample=proc.resample)
                pixels = torch.from_numpy(np.array(resized, dtype=np.uint8))
            return token_blocks(pixels, proc.factor)
        levels = pixel_levels(pixels.reshape(pixels.shape[0], 3, -1), proc, channel_dim=1)
        return levels.reshape(pixels.shape[0] // proc.merge_size ** 2, -1)

    def _pixels(self, image: SourceImage, kwargs: dict, cache: PixelCache,
                device: str | None) -> tuple[str, torch.Tensor, Grid, bool]:
        """(hash, pixels, grid, worth keeping in the pixel cache). Only pixels that took work (a resize, GPU
        preprocessing) are kept: without a resize the compact pixels are one copy of the decoded ones, cheaper
        than holding fresh memory whose first touch costs more than the copy (2.4 against 0.4 ms a 1008x756
        prompt, measured on the host)."""
        proc = self.processor
        unknown = set(kwargs) - {"min_pixels", "max_pixels"}
        if unknown:
            raise InvalidRequestError(f"unknown mm_processor_kwargs {sorted(unknown)} (min_pixels, max_pixels)")
        lo, hi = kwargs.get("min_pixels"), kwargs.get("max_pixels")
        params = proc.processor_params(lo, hi)  # validates the overrides
        width, height = image.size
        target = qwen_target_size(proc, height, width, lo, hi)
        resized = target != (height, width)
        # The RGB bytes (load_image always gives RGB), read once for the hash and, without a resize, the pixels.
        raw = image.array if image.array is not None else image.pil.tobytes()
        mm_hash = hash_pixels("RGB", width, height, params, raw)
        cached = cache.get(mm_hash)
        if cached is not None:
            return mm_hash, *cached, False
        deferred = (resized and device is None and self.resize_where_decoded and supports(proc.resample)
                    and height * width <= self.MAX_DEFERRED_SCALE * target[0] * target[1])
        if deferred or (not resized and device is None):  # the runner resizes (if need be) and finishes it
            # A copy: torch wants writable memory, and an array's owner may reuse it. numpy copies with the GIL
            # released (a bytearray copy held it through the fresh pages' faults, ~3 ms a 1008x756 picture, while
            # the engine's thread waited for the GIL).
            pixels = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(height, width, 3)
            return mm_hash, pixels, (1, target[0] // proc.patch_size, target[1] // proc.patch_size), False
        img = image.to_pil()  # an array is resized like any other picture
        if device is None:  # the compact uint8 image; the runner finishes it on its device
            return mm_hash, *proc.preprocess_compact(img, min_pixels=lo, max_pixels=hi), True
        return mm_hash, *proc.preprocess(img, min_pixels=lo, max_pixels=hi, device=device), True
