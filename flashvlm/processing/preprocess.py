"""Image preprocessing per model family, matching the HF transformers (5.x) PIL-backend processors.

The order of operations is the reference's, so results match it bit for bit on CPU:
resize on the uint8 PIL image (Pillow's fixed-point resampler, exactly as HF's PIL backend does),
then rescale in float64 cast to float32, then ``(x - mean) / std`` in float32. Qwen's float steps and
patchify run wherever the resized uint8 image is (``device=``) as one table lookup computed on the CPU, so
they are bit-identical on an accelerator too; CLIP's run there directly (the division may differ by an ulp).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from flashvlm.request import InvalidRequestError

__all__ = [
    "ClipImageProcessor",
    "ImageProcessor",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "QwenImageProcessor",
    "get_image_processor",
    "smart_resize",
]

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = int(Image.Resampling.BICUBIC)
MAX_ASPECT_RATIO = 200
"""Refused above this (either family): the Qwen rule HF applies, and slivers whose resize would take gigabytes."""
_MAX_PAD_CANVAS_PIXELS = 16384 * 16384
"""LLaVA's pad-to-square canvas (3 bytes a pixel) before it shrinks to 336x336: 800 MB at most, which still takes
a 50-megapixel photo (the server's default image limit) of aspect ratio up to 5."""


def check_image_shape(height: int, width: int) -> None:
    """Refuse shapes no processor should resize: empty ones, and sliver images whose resize (a shortest-edge
    rule stretches the long side by the same factor) or pad-to-square would take gigabytes."""
    if height <= 0 or width <= 0:
        raise InvalidRequestError(f"zero-size image: {width}x{height} (width x height)")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise InvalidRequestError(
            f"image aspect ratio {ratio:.1f} ({width}x{height}) exceeds the limit of {MAX_ASPECT_RATIO}"
        )


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


def _rgb(img: Image.Image) -> Image.Image:
    return img if img.mode == "RGB" else img.convert("RGB")


def _pos_int(d: Mapping[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"preprocessor config: {key!r} must be a positive integer, got {v!r}")
    return v


def _triple(d: Mapping[str, Any], key: str, default: Sequence[float]) -> tuple[float, ...]:
    v = d.get(key)
    if v is None:
        return tuple(default)
    v = [v] * 3 if isinstance(v, (int, float)) else list(v)
    if len(v) != 3:
        raise ValueError(f"preprocessor config: {key!r} must have 3 values (RGB), got {v!r}")
    return tuple(float(x) for x in v)


def _normalize(arr: np.ndarray, proc: QwenImageProcessor | ClipImageProcessor,
               device: torch.device | str | None) -> torch.Tensor:
    """uint8 HxWxC -> float32 rescaled + normalized, with HF's dtype sequence (see module doc)."""
    # np.asarray(PIL image) is read-only; torch wants a writable buffer, so copy only then.
    arr = np.ascontiguousarray(arr) if arr.flags.writeable else np.array(arr, order="C")
    x = torch.from_numpy(arr).to(device)
    if proc.do_rescale:
        x = (x.to(torch.float64) * proc.rescale_factor).to(torch.float32)
    else:
        x = x.to(torch.float32)
    if proc.do_normalize:
        mean = torch.tensor(proc.image_mean, dtype=torch.float32, device=x.device)
        std = torch.tensor(proc.image_std, dtype=torch.float32, device=x.device)
        x = (x - mean) / std
    return x


def _value_table(proc: QwenImageProcessor | ClipImageProcessor) -> torch.Tensor:
    """(C * 256,) float32, channel-major: what `_normalize` turns each uint8 value of each channel into. The same
    elementwise float64/float32 operations on the 256 possible values, so a lookup is bit-identical to them."""
    return _normalize(np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1), proc, None).T.contiguous().flatten()


@dataclass
class QwenImageProcessor:
    """Qwen2-VL / Qwen2.5-VL: smart-resize to multiples of patch*merge, patchify to flat rows."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = _BICUBIC
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
        min_px = _pos_int(d, "min_pixels", min_px)
        max_px = _pos_int(d, "max_pixels", max_px)
        if min_px > max_px:
            raise ValueError(f"preprocessor config: min_pixels {min_px} > max_pixels {max_px}")
        return cls(
            patch_size=_pos_int(d, "patch_size", cls.patch_size),
            temporal_patch_size=_pos_int(d, "temporal_patch_size", cls.temporal_patch_size),
            merge_size=_pos_int(d, "merge_size", cls.merge_size),
            min_pixels=min_px,
            max_pixels=max_px,
            image_mean=_triple(d, "image_mean", OPENAI_CLIP_MEAN),
            image_std=_triple(d, "image_std", OPENAI_CLIP_STD),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_resize=bool(d.get("do_resize", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            resample=int(d.get("resample", _BICUBIC)),
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
        lookup (the normalization of each of the 256 values of each channel, computed like `_normalize`), then
        the temporal copy."""
        h, w, c = x.shape
        rows = self._patchify(x, h, w)  # (patches, C*P*P) uint8, a strided view until the lookup gathers it
        n, cols = rows.shape
        per_channel = cols // c
        offsets = torch.arange(0, 256 * c, 256, dtype=torch.int32, device=x.device).repeat_interleave(per_channel)
        values = torch.index_select(self._table_on(x.device), 0, (rows.to(torch.int32) + offsets).reshape(-1))
        t = self.temporal_patch_size
        return values.view(n, c, 1, per_channel).expand(n, c, t, per_channel).reshape(n, c * t * per_channel)

    def _resized(self, img: Image.Image, min_pixels: int | None, max_pixels: int | None) -> Image.Image:
        img = _rgb(img)
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

    def _table_on(self, device: torch.device) -> torch.Tensor:
        """The normalization lookup table, made once per device (kept outside the dataclass fields)."""
        tables = self.__dict__.setdefault("_tables_by_device", {})
        key = str(device)
        if key not in tables:
            tables[key] = _value_table(self).to(device)
        return tables[key]

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
class ClipImageProcessor:
    """CLIP / LLaVA-1.5 (llava-hf): [pad to square] -> shortest-edge resize -> center crop -> normalize."""

    shortest_edge: int | None = 336
    resize_hw: tuple[int, int] | None = None
    """Fixed (height, width) resize, used when the config's ``size`` is {height, width}."""
    crop_hw: tuple[int, int] = (336, 336)
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_pad: bool = False
    """LlavaImageProcessor's pad-to-square with the mean colour, before resizing."""
    resample: int = _BICUBIC

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> ClipImageProcessor:
        """Build from a CLIPImageProcessor / LlavaImageProcessor ``preprocessor_config.json`` dict."""
        size = d.get("size", {"shortest_edge": 224})
        shortest, resize_hw = None, None
        if isinstance(size, int):  # HF treats a bare int as the shortest edge for CLIP
            shortest = size
        elif "shortest_edge" in size and "longest_edge" not in size:
            shortest = _pos_int(size, "shortest_edge", 224)
        elif "height" in size and "width" in size:
            resize_hw = (_pos_int(size, "height", 0), _pos_int(size, "width", 0))
        else:
            raise ValueError(f"preprocessor config: unsupported CLIP size {size!r}")
        crop = d.get("crop_size", {"height": 224, "width": 224})
        crop_hw = (crop, crop) if isinstance(crop, int) else (_pos_int(crop, "height", 0),
                                                             _pos_int(crop, "width", 0))
        return cls(
            shortest_edge=shortest, resize_hw=resize_hw, crop_hw=crop_hw,
            image_mean=_triple(d, "image_mean", OPENAI_CLIP_MEAN),
            image_std=_triple(d, "image_std", OPENAI_CLIP_STD),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_resize=bool(d.get("do_resize", True)),
            do_center_crop=bool(d.get("do_center_crop", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            do_normalize=bool(d.get("do_normalize", True)),
            do_pad=bool(d.get("do_pad", False)),
            resample=int(d.get("resample", _BICUBIC)),
        )

    def resize_target(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resize; the short edge rule truncates the long edge like HF."""
        if self.resize_hw is not None:
            return self.resize_hw
        assert self.shortest_edge is not None
        s = self.shortest_edge
        if width <= height:
            return int(s * height / width), s
        return s, int(s * width / height)

    def output_hw(self, height: int, width: int) -> tuple[int, int]:
        if self.do_center_crop:
            return self.crop_hw
        if self.do_pad:
            height = width = max(height, width)
        return self.resize_target(height, width) if self.do_resize else (height, width)

    def num_image_tokens(self, patch_size: int = 14, select_strategy: str = "default",
                         num_additional_image_tokens: int = 1) -> int:
        """Placeholder tokens per image, as LlavaProcessor counts them.

        Pass ``vision_config.patch_size`` and ``config.vision_feature_select_strategy``; 'default'
        drops the CLS token, e.g. (336 // 14) ** 2 = 576, 'full' keeps it.
        """
        if self.do_center_crop:
            h, w = self.crop_hw
        elif self.resize_hw is not None and self.do_resize and not self.do_pad:
            h, w = self.resize_hw
        else:
            raise ValueError("token count depends on the image size without a center crop or fixed resize")
        n = (h // patch_size) * (w // patch_size) + num_additional_image_tokens
        if select_strategy == "default":
            return n - 1
        if select_strategy == "full":
            return n
        raise ValueError(f"unknown vision_feature_select_strategy {select_strategy!r}")

    def preprocess(self, img: Image.Image, device: torch.device | str | None = None) -> torch.Tensor:
        """-> pixel_values float32 (3, H, W)."""
        check_image_shape(img.height, img.width)
        img = _rgb(img)
        if self.do_pad and img.width != img.height:
            side = max(img.width, img.height)
            if side * side > _MAX_PAD_CANVAS_PIXELS:
                raise InvalidRequestError(f"image {img.width}x{img.height} pads to a {side}x{side} square, above "
                                          f"the {_MAX_PAD_CANVAS_PIXELS:,} pixels this processor pads")
            fill = tuple(int(m * 255) for m in self.image_mean)  # HF truncates, it does not round
            canvas = Image.new("RGB", (side, side), fill)
            canvas.paste(img, ((side - img.width) // 2, (side - img.height) // 2))
            img = canvas
        if self.do_resize:
            h, w = self.resize_target(img.height, img.width)
            if (h, w) != (img.height, img.width):
                img = img.resize((w, h), resample=self.resample)
        arr = np.asarray(img)
        if self.do_center_crop:
            arr = _center_crop(arr, *self.crop_hw)
        return _normalize(arr, self, device).permute(2, 0, 1).contiguous()

    def processor_params(self) -> dict[str, Any]:
        """Everything that changes pixel_values, for the content hash."""
        return {
            "family": "clip", "shortest_edge": self.shortest_edge, "resize_hw": self.resize_hw,
            "crop_hw": list(self.crop_hw), "image_mean": list(self.image_mean),
            "image_std": list(self.image_std), "rescale_factor": self.rescale_factor,
            "do_resize": self.do_resize, "do_center_crop": self.do_center_crop, "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize, "do_pad": self.do_pad, "resample": self.resample,
        }


def _center_crop(arr: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """Center crop HxWxC; an image smaller than the crop is zero-padded first, with HF's offsets."""
    h, w = arr.shape[:2]
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0:
        return arr[top:top + ch, left:left + cw]
    nh, nw = max(ch, h), max(cw, w)
    pt, pl = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded = np.zeros((nh, nw, arr.shape[2]), dtype=arr.dtype)
    padded[pt:pt + h, pl:pl + w] = arr
    top, left = top + pt, left + pl
    return padded[max(0, top):min(nh, top + ch), max(0, left):min(nw, left + cw)]


ImageProcessor = QwenImageProcessor | ClipImageProcessor

_FAMILIES: dict[str, type[QwenImageProcessor] | type[ClipImageProcessor]] = {
    "qwen2_vl": QwenImageProcessor,
    "qwen2_5_vl": QwenImageProcessor,
    "llava": ClipImageProcessor,
}


def get_image_processor(preprocessor_config: Mapping[str, Any], model_type: str) -> ImageProcessor:
    """Pick the processor for ``config.model_type``; unknown families raise ValueError."""
    cls = _FAMILIES.get(model_type)
    if cls is None:
        raise ValueError(f"no image processor for model_type {model_type!r}; known: {sorted(_FAMILIES)}")
    return cls.from_config(preprocessor_config or {})
