"""LLaVA-NeXT (llava-hf LLaVA-1.6) images: any-resolution tiling, as HF's LlavaNextImageProcessor (PIL backend) does.

The picture is fitted (aspect kept) into the best of `image_grid_pinpoints`, zero-padded (raw 0, before rescale) to
it, and cut into tile-sized crops in raster order; in front of them comes the whole picture resized to one tile
(aspect not kept). Each of these then takes CLIP's per-image steps (shortest-edge resize, center crop, rescale,
normalize; `clip_image.ClipImageProcessor`), so an item's pixel_values are (1 + crops, 3, tile, tile). The crop grid
and the feature rows and columns the padding takes are the item's layout (`anyres.AnyResLayout`); the token count
follows from them, so it depends on the picture's aspect."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from flashvlm.processing.anyres import (
    AnyResLayout,
    best_resolution,
    fitted_size,
    largest_layout,
    layout_for,
    pad_offsets,
    parse_pinpoints,
)
from flashvlm.processing.clip_image import ClipImageProcessor
from flashvlm.processing.preprocess import (
    SourceImage,
    cached_preprocess,
    check_image_shape,
    lookup_normalize,
    positive_int,
    to_rgb,
)
from flashvlm.processing.resample import resize_images
from flashvlm.request import InvalidRequestError, MMItem

if TYPE_CHECKING:
    from flashvlm.processing.pixel_cache import PixelCache
    from flashvlm.pruning.base import TokenGrid

DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
"""HF's default image_grid_pinpoints (a config without them gets these, as there)."""


@dataclass
class LlavaNextImageProcessor:
    """Tiling on top of CLIP's per-image steps, which each tile (and the base image) then takes."""

    clip: ClipImageProcessor
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    base_hw: tuple[int, int] = (336, 336)
    """What the whole picture is resized to, aspect not kept: `size` as (height, width), a shortest edge twice."""
    tile: int = 336
    """Side of the crops the fitted picture is cut into (crop_size's height, as HF takes it)."""

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> LlavaNextImageProcessor:
        """Build from a LlavaNextImageProcessor ``preprocessor_config.json`` dict. Its ``do_pad`` pads a batch to
        one crop count (nothing here: each item keeps its own), not CLIP's pad-to-square, so it is not passed on.
        Missing sizes default to the 336-pixel tiles of HF's default pinpoints (HF's class defaults, 224, do not
        divide them)."""
        d = dict(d)
        size = d.setdefault("size", {"shortest_edge": 336})
        d.setdefault("crop_size", {"height": 336, "width": 336})
        clip = ClipImageProcessor.from_config({**d, "do_pad": False})
        if isinstance(size, int):
            base_hw = (size, size)
        elif "height" in size and "width" in size:
            base_hw = (positive_int(size, "height", 0), positive_int(size, "width", 0))
        else:
            side = positive_int(size, "shortest_edge", 224)
            base_hw = (side, side)
        crop = d["crop_size"]
        tile = crop if isinstance(crop, int) else positive_int(crop, "height", 0)
        pinpoints = parse_pinpoints(d.get("image_grid_pinpoints", [list(p) for p in DEFAULT_PINPOINTS]), tile)
        return cls(clip=clip, pinpoints=pinpoints, base_hw=base_hw, tile=tile)

    def tile_hw(self) -> tuple[int, int]:
        """(height, width) of every preprocessed tile: the CLIP steps' output for a tile-sized square."""
        return self.clip.output_hw(self.tile, self.tile)

    def layout(self, height: int, width: int, side: int) -> AnyResLayout:
        return layout_for(height, width, self.pinpoints, self.tile, side)

    def preprocess(self, img: Image.Image, device: torch.device | str | None = None) -> torch.Tensor:
        """-> pixel_values float32 (1 + crops, 3, H, W): the base image, then the crops row by row."""
        check_image_shape(img.height, img.width)
        img = to_rgb(img)
        best = best_resolution(img.height, img.width, self.pinpoints)
        fitted = fitted_size(img.height, img.width, *best)
        # The two resizes of the picture are independent: they run side by side when threads allow.
        resized, base = resize_images([img, img], [fitted, self.base_hw], self.clip.resample)
        canvas = np.zeros((*best, 3), dtype=np.uint8)
        top, left = pad_offsets(fitted, best)
        canvas[top:top + fitted[0], left:left + fitted[1]] = np.asarray(resized)
        t = self.tile
        if self._tiles_only_normalize():
            # Every tile (and the base) is already the tower's size: CLIP's resize and crop leave it as it is, so
            # all of them take the normalization at once, without a PIL image per tile.
            crops = canvas.reshape(best[0] // t, t, best[1] // t, t, 3).transpose(0, 2, 1, 3, 4).reshape(-1, t, t, 3)
            levels = np.concatenate([np.asarray(base)[None], crops])
            return lookup_normalize(torch.from_numpy(levels).to(device), self.clip)
        tiles = [base] + [Image.fromarray(canvas[r:r + t, c:c + t]) for r in range(0, best[0], t)
                          for c in range(0, best[1], t)]
        return torch.stack([self.clip.preprocess(tile, device=device) for tile in tiles])

    def _tiles_only_normalize(self) -> bool:
        """Whether CLIP's steps change no tile-sized square (and the base image is one) but for normalizing."""
        clip, square = self.clip, (self.tile, self.tile)
        return (self.base_hw == square and not clip.do_pad
                and (not clip.do_resize or clip.resize_target(*square) == square)
                and (not clip.do_center_crop or clip.crop_hw == square))

    def processor_params(self) -> dict[str, Any]:
        """Everything that changes pixel_values, for the content hash."""
        return {**self.clip.processor_params(), "family": "llava_next",
                "pinpoints": [list(p) for p in self.pinpoints], "base_hw": list(self.base_hw), "tile": self.tile}


@dataclass
class LlavaNextImageInputs:
    """LLaVA-NeXT's `preprocess.ImageInputs`. `side`: the tower's patches per tile edge (image_size // patch_size)."""

    processor: LlavaNextImageProcessor
    side: int

    def make_item(self, image: SourceImage, kwargs: dict, cache: PixelCache, device: str | None) -> MMItem:
        if kwargs:
            raise InvalidRequestError(f"this model takes no mm_processor_kwargs, got {sorted(kwargs)}")
        proc = self.processor
        width, height = image.size
        check_image_shape(height, width)
        mm_hash, pixels, layout = cached_preprocess(
            image, proc.processor_params(), cache,
            lambda pil: (proc.preprocess(pil, device=device), proc.layout(height, width, self.side)))
        return MMItem(mm_hash=mm_hash, pixel_values=pixels, num_tokens=layout.num_tokens, layout=layout,
                      image_size=image.size)

    def profile_item(self) -> MMItem:
        """The heaviest image: the most tokens and crops any picture gets."""
        proc = self.processor
        layout = largest_layout(proc.pinpoints, proc.tile, self.side)
        return MMItem(mm_hash="memory-profile", pixel_values=torch.zeros(1 + layout.num_crops, 3, *proc.tile_hw()),
                      num_tokens=layout.num_tokens, layout=layout)

    def token_grid(self, item: MMItem) -> TokenGrid | None:
        """None: the base image's grid, then the unpadded tile grid with a newline token closing each row, are no
        single grid a pruning strategy could select on."""
        return None

