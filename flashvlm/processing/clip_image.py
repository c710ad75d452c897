"""CLIP / LLaVA-1.5 (llava-hf) images: [pad to square] -> shortest-edge resize -> center crop -> normalize (HF's
CLIPImageProcessor and LlavaImageProcessor, PIL backend; see `preprocess.py` for the order of operations), and the
`MMItem`s they make: a fixed-size (3, H, W) image and a fixed placeholder count, no layout."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from flashvlm.processing.preprocess import (
    PixelSettings,
    SourceImage,
    cached_preprocess,
    check_image_shape,
    lookup_normalize,
    pixel_levels,
    positive_int,
    to_rgb,
    token_blocks,
)
from flashvlm.pruning.base import TokenGrid
from flashvlm.request import InvalidRequestError, MMItem

if TYPE_CHECKING:
    from flashvlm.processing.pixel_cache import PixelCache

_MAX_PAD_CANVAS_PIXELS = 16384 * 16384
"""LLaVA's pad-to-square canvas (3 bytes a pixel) before it shrinks to 336x336: 800 MB at most, which still takes
a 50-megapixel photo (the server's default image limit) of aspect ratio up to 5."""


@dataclass
class ClipImageProcessor(PixelSettings):
    """CLIP / LLaVA-1.5 (llava-hf): [pad to square] -> shortest-edge resize -> center crop -> normalize."""

    shortest_edge: int | None = 336
    resize_hw: tuple[int, int] | None = None
    """Fixed (height, width) resize, used when the config's ``size`` is {height, width}."""
    crop_hw: tuple[int, int] = (336, 336)
    do_center_crop: bool = True
    do_pad: bool = False
    """LlavaImageProcessor's pad-to-square with the mean colour, before resizing."""

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> ClipImageProcessor:
        """Build from a CLIPImageProcessor / LlavaImageProcessor ``preprocessor_config.json`` dict."""
        size = d.get("size", {"shortest_edge": 224})
        shortest, resize_hw = None, None
        if isinstance(size, int):  # HF treats a bare int as the shortest edge for CLIP
            shortest = size
        elif "shortest_edge" in size and "longest_edge" not in size:
            shortest = positive_int(size, "shortest_edge", 224)
        elif "height" in size and "width" in size:
            resize_hw = (positive_int(size, "height", 0), positive_int(size, "width", 0))
        else:
            raise ValueError(f"preprocessor config: unsupported CLIP size {size!r}")
        crop = d.get("crop_size", {"height": 224, "width": 224})
        crop_hw = (crop, crop) if isinstance(crop, int) else (positive_int(crop, "height", 0),
                                                             positive_int(crop, "width", 0))
        return cls(
            shortest_edge=shortest, resize_hw=resize_hw, crop_hw=crop_hw,
            do_center_crop=bool(d.get("do_center_crop", True)),
            do_pad=bool(d.get("do_pad", False)),
            **PixelSettings.settings_from_config(d),
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
        img = to_rgb(img)
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
            arr = center_crop(arr, *self.crop_hw)
        # np.array copies (a byte a value): PIL's array is read-only and the crop a view, torch wants owned memory.
        return lookup_normalize(torch.from_numpy(np.array(arr, order="C")).to(device), self)

    def processor_params(self) -> dict[str, Any]:
        """Everything that changes pixel_values, for the content hash."""
        return {
            "family": "clip", "shortest_edge": self.shortest_edge, "resize_hw": self.resize_hw,
            "crop_hw": list(self.crop_hw), "image_mean": list(self.image_mean),
            "image_std": list(self.image_std), "rescale_factor": self.rescale_factor,
            "do_resize": self.do_resize, "do_center_crop": self.do_center_crop, "do_rescale": self.do_rescale,
            "do_normalize": self.do_normalize, "do_pad": self.do_pad, "resample": self.resample,
        }


def center_crop(arr: np.ndarray, ch: int, cw: int) -> np.ndarray:
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


@dataclass
class ClipImageInputs:
    """LLaVA's `preprocess.ImageInputs`: every image is cropped to the tower's size and yields the same number
    of tokens, which depends on the model's patch size and feature select strategy."""

    processor: ClipImageProcessor
    patch_size: int
    select_strategy: str = "default"

    @property
    def num_tokens(self) -> int:
        return self.processor.num_image_tokens(self.patch_size, self.select_strategy)

    def make_item(self, image: SourceImage, kwargs: dict, cache: PixelCache, device: str | None) -> MMItem:
        if kwargs:
            raise InvalidRequestError(f"this model takes no mm_processor_kwargs, got {sorted(kwargs)}")
        proc = self.processor
        mm_hash, pixels, _ = cached_preprocess(image, proc.processor_params(), cache,
                                               lambda pil: (proc.preprocess(pil, device=device), None))
        return MMItem(mm_hash=mm_hash, pixel_values=pixels, num_tokens=self.num_tokens, image_size=image.size)

    def profile_item(self) -> MMItem:
        return MMItem(mm_hash="memory-profile", pixel_values=torch.zeros(3, *self.processor.crop_hw),
                      num_tokens=self.num_tokens)

    def token_grid(self, item: MMItem) -> TokenGrid | None:
        """CLIP's patch grid of the tower's fixed input size (row by row); None when the tokens also hold the
        CLS token (vision_feature_select_strategy 'full'), which sits at no grid position."""
        if self.select_strategy != "default":
            return None
        proc = self.processor
        height, width = proc.crop_hw if proc.do_center_crop else proc.resize_hw
        return TokenGrid(1, height // self.patch_size, width // self.patch_size)

    def token_pixels(self, item: MMItem) -> torch.Tensor:
        """(tokens, F) uint8: the cropped image's levels in each patch of `token_grid`."""
        levels = pixel_levels(torch.as_tensor(item.pixel_values), self.processor, channel_dim=0)
        return token_blocks(levels.permute(1, 2, 0), self.patch_size)
