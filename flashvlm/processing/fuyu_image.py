"""Fuyu images (HF's FuyuImageProcessor, PIL backend, and FuyuProcessor's placeholder layout): an image larger than
the canvas (`size`, 1080x1920 for adept/fuyu-8b) shrinks to fit it, aspect kept; the bottom and right edges are
padded with `padding_value` up to whole 30x30 patches; each patch, laid out (row, column, channel), is one row of
the model's pixels. The prompt holds, per row of patches, one `|SPEAKER|` placeholder per patch and one
`|NEWLINE|`, so an item's (rows, cols) grid is its layout and it spans rows * (cols + 1) tokens. The host keeps the
padded uint8 image, which the runner finishes on its device (`decode_compact`), as Qwen's images do."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from PIL import Image

from flashvlm.processing.hashing import hash_pixels
from flashvlm.processing.preprocess import (
    PixelSettings,
    SourceImage,
    check_image_shape,
    positive_int,
    table_on,
    to_rgb,
)
from flashvlm.request import InvalidRequestError, MMItem

if TYPE_CHECKING:
    from flashvlm.processing.pixel_cache import PixelCache
    from flashvlm.pruning.base import TokenGrid

BILINEAR = int(Image.Resampling.BILINEAR)
IMAGE_TOKEN = "|SPEAKER|"
NEWLINE_TOKEN = "|NEWLINE|"
BEGIN_ANSWER = "<0x04>"
"""What FuyuProcessor appends to the text of a prompt with an image (its beginning-of-answer token)."""
BOS = "<s>"
"""What FuyuProcessor puts between the image's tokens and the text (the literal string, tokenized)."""


def _hw(d: Mapping[str, Any], key: str, default: tuple[int, int]) -> tuple[int, int]:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, Mapping):
        raise ValueError(f"preprocessor config: {key!r} must be {{'height': int, 'width': int}}, got {value!r}")
    return positive_int(value, "height", default[0]), positive_int(value, "width", default[1])


@dataclass
class FuyuImageProcessor(PixelSettings):
    """Fit into the canvas, pad to whole patches, patchify; normalize with mean = std = 0.5 by default."""

    canvas_hw: tuple[int, int] = (1080, 1920)
    patch_hw: tuple[int, int] = (30, 30)
    do_pad: bool = True
    pad_value: int = 1
    """padding_value on the 0..255 scale: HF pads before rescaling, so 1.0 is the uint8 value 1."""

    @classmethod
    def from_config(cls, d: Mapping[str, Any]) -> FuyuImageProcessor:
        """Build from a FuyuImageProcessor ``preprocessor_config.json`` dict."""
        canvas = _hw(d, "size", cls.canvas_hw)
        patch = _hw(d, "patch_size", cls.patch_hw)
        mode = d.get("padding_mode", "constant")
        if mode != "constant":
            raise ValueError(f"preprocessor config: padding_mode {mode!r} is not supported (only 'constant')")
        value = float(d.get("padding_value", 1.0))
        if not (value.is_integer() and 0 <= value <= 255):
            raise ValueError(f"preprocessor config: padding_value {value} must be a whole number in [0, 255]")
        do_pad = bool(d.get("do_pad", True))
        if do_pad and (canvas[0] % patch[0] or canvas[1] % patch[1]):
            raise ValueError(f"preprocessor config: the {canvas[0]}x{canvas[1]} canvas is not a whole number of "
                             f"{patch[0]}x{patch[1]} patches")
        defaults = {"image_mean": 0.5, "image_std": 0.5, "resample": BILINEAR}
        return cls(canvas_hw=canvas, patch_hw=patch, do_pad=do_pad, pad_value=int(value),
                   **PixelSettings.settings_from_config({**defaults, **d}))

    @property
    def patch_features(self) -> int:
        return 3 * self.patch_hw[0] * self.patch_hw[1]

    def resized_hw(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize: shrunk to fit the canvas (HF truncates), never enlarged."""
        check_image_shape(height, width)
        ch, cw = self.canvas_hw
        if height <= ch and width <= cw:
            return height, width
        if not self.do_resize:
            raise InvalidRequestError(f"image {width}x{height} is larger than the {cw}x{ch} canvas and this "
                                      "model's processor does not resize (do_resize false)")
        scale = min(ch / height, cw / width)
        return max(1, int(height * scale)), max(1, int(width * scale))

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of patches for an image of this size, without touching pixels."""
        h, w = self.resized_hw(height, width)
        ph, pw = self.patch_hw
        if not self.do_pad and (h % ph or w % pw):
            raise InvalidRequestError(f"image {w}x{h} is not a whole number of {pw}x{ph} patches and this "
                                      "model's processor does not pad (do_pad false)")
        return math.ceil(h / ph), math.ceil(w / pw)

    def max_grid(self) -> tuple[int, int]:
        return self.canvas_hw[0] // self.patch_hw[0], self.canvas_hw[1] // self.patch_hw[1]

    @staticmethod
    def num_image_tokens(grid: tuple[int, int]) -> int:
        """Placeholders of one image: a row of patches and its newline, per row."""
        rows, cols = grid
        return rows * (cols + 1)

    def preprocess_compact(self, img: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """-> (the resized image padded to whole patches, uint8 (rows * ph, cols * pw, 3); its (rows, cols))."""
        img = to_rgb(img)
        grid = self.grid(img.height, img.width)
        h, w = self.resized_hw(img.height, img.width)
        if (h, w) != (img.height, img.width):
            img = img.resize((w, h), resample=self.resample)
        return self._padded(np.asarray(img), grid), grid

    def _padded(self, arr: np.ndarray, grid: tuple[int, int]) -> torch.Tensor:
        rows, cols = grid
        out = np.full((rows * self.patch_hw[0], cols * self.patch_hw[1], 3), self.pad_value, dtype=np.uint8)
        out[:arr.shape[0], :arr.shape[1]] = arr
        return torch.from_numpy(out)

    def decode_compact(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (H, W, C) of `preprocess_compact` -> float32 (patches, ph * pw * C): patches in raster order, each
        (row, column, channel) as HF's patchify lays it out, every value through the normalization table."""
        ph, pw = self.patch_hw
        h, w, c = x.shape
        rows = x.reshape(h // ph, ph, w // pw, pw, c).permute(0, 2, 1, 3, 4).reshape(-1, ph * pw * c)
        offsets = torch.arange(0, 256 * c, 256, dtype=torch.int32, device=x.device).repeat(ph * pw)
        return torch.index_select(table_on(self, x.device), 0, (rows.to(torch.int32) + offsets).reshape(-1)) \
            .view(rows.shape)

    def preprocess(self, img: Image.Image, device: torch.device | str | None = None
                   ) -> tuple[torch.Tensor, tuple[int, int]]:
        """-> (pixel_values float32 (rows * cols, ph * pw * 3) on `device`, (rows, cols))."""
        compact, grid = self.preprocess_compact(img)
        return self.decode_compact(compact if device is None else compact.to(device)), grid

    def processor_params(self) -> dict[str, Any]:
        """Everything that changes pixel_values, for the content hash."""
        return {"family": "fuyu", "canvas_hw": list(self.canvas_hw), "patch_hw": list(self.patch_hw),
                "do_pad": self.do_pad, "pad_value": self.pad_value, "image_mean": list(self.image_mean),
                "image_std": list(self.image_std), "rescale_factor": self.rescale_factor,
                "do_resize": self.do_resize, "do_rescale": self.do_rescale, "do_normalize": self.do_normalize,
                "resample": self.resample}


@dataclass
class FuyuImageInputs:
    """Fuyu's `preprocess.ImageInputs`: items whose layout is the (rows, cols) patch grid, and the two prompt rules
    of FuyuProcessor that the input processor asks its image part for (`encode_prompt`, `placeholder_ids`)."""

    processor: FuyuImageProcessor
    image_token_id: int
    newline_token_id: int
    max_images_per_prompt: int = 1
    """FuyuProcessor places one image per prompt, in front of the text; the input processor refuses more."""

    def make_item(self, image: SourceImage, kwargs: dict, cache: PixelCache, device: str | None) -> MMItem:
        if kwargs:
            raise InvalidRequestError(f"this model takes no mm_processor_kwargs, got {sorted(kwargs)}")
        proc = self.processor
        width, height = image.size
        grid = proc.grid(height, width)  # refuses what the processor cannot take before hashing
        raw = image.array if image.array is not None else image.pil.tobytes()
        mm_hash = hash_pixels("RGB", width, height, proc.processor_params(), raw)
        cached = cache.get(mm_hash)
        if cached is not None:
            pixels, grid = cached
        elif device is None:
            if proc.resized_hw(height, width) == (height, width) and image.array is not None:
                pixels = proc._padded(image.array, grid)
            else:
                pixels, grid = proc.preprocess_compact(image.to_pil())
            cache.put(mm_hash, pixels, grid)
        else:
            pixels, grid = proc.preprocess(image.to_pil(), device=device)
            cache.put(mm_hash, pixels, grid)
        decoder = proc.decode_compact if pixels.dtype == torch.uint8 else None
        return MMItem(mm_hash=mm_hash, pixel_values=pixels, num_tokens=proc.num_image_tokens(grid), layout=grid,
                      image_size=image.size, pixel_decoder=decoder)

    def profile_item(self) -> MMItem:
        """The largest image: the whole canvas, as zero float pixels."""
        grid = self.processor.max_grid()
        pixels = torch.zeros(grid[0] * grid[1], self.processor.patch_features)
        return MMItem(mm_hash="memory-profile", pixel_values=pixels, num_tokens=self.processor.num_image_tokens(grid),
                      layout=grid)

    def token_grid(self, item: MMItem) -> TokenGrid | None:
        """None: every row of patches ends in a newline token, which sits at no grid position, so pruning (which
        selects on a grid of the tower's output) does not apply."""
        return None

    def placeholder_ids(self, item: MMItem, placeholder_id: int) -> list[int]:
        """The ids one image placeholder expands to: per row of patches, one placeholder a patch, then a newline."""
        rows, cols = item.layout
        return ([placeholder_id] * cols + [self.newline_token_id]) * rows

    def encode_prompt(self, tokenizer: Any, text: str, num_images: int) -> list[int]:
        """A raw prompt's ids as FuyuProcessor builds them: with an image, the image's placeholder, then "<s>",
        then the text with the beginning-of-answer token "<0x04>" appended, tokenized without special tokens;
        text alone is tokenized with them. FuyuProcessor puts the image in front whatever the text says, so one
        leading "|SPEAKER|" in the text (the family's image_placeholder, as the benchmark writes it) is the image's
        place, and dropped."""
        if not num_images:
            return tokenizer.encode(text, add_special_tokens=True)
        text = text.removeprefix(IMAGE_TOKEN)
        if IMAGE_TOKEN in text:
            raise InvalidRequestError(f"this model's prompt puts its image in front of the text, as FuyuProcessor "
                                      f"does; {IMAGE_TOKEN} may only open the prompt")
        return [self.image_token_id, tokenizer.convert_tokens_to_ids(BOS),
                *tokenizer.encode(text + BEGIN_ANSWER, add_special_tokens=False)]
