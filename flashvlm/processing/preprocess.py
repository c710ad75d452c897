"""What every family's image preprocessing shares: the checks on an image's shape, reading a preprocessor config,
the rescale + normalize step, and the contract between a family's image part and `InputProcessor`.

The families' processors (`qwen_image.py`, `clip_image.py`) match the HF transformers (5.x) PIL-backend
processors, in the reference's order of operations, so results match it bit for bit on CPU: resize on the uint8
PIL image (Pillow's fixed-point resampler, exactly as HF's PIL backend does), then rescale in float64 cast to
float32, then ``(x - mean) / std`` in float32. Qwen's float steps and patchify run wherever the resized uint8
image is (``device=``) as one table lookup computed on the CPU, so they are bit-identical on an accelerator too;
so do CLIP's and LLaVA-NeXT's (`lookup_normalize`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from PIL import Image

from flashvlm.request import InvalidRequestError, MMItem

if TYPE_CHECKING:
    from flashvlm.processing.pixel_cache import PixelCache
    from flashvlm.pruning.base import TokenGrid

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC = int(Image.Resampling.BICUBIC)
MAX_ASPECT_RATIO = 200
"""Refused above this (every family): the Qwen rule HF applies, and slivers whose resize would take gigabytes."""


@dataclass(frozen=True)
class SourceImage:
    """A decoded picture as a request gave it: a PIL image, or an RGB uint8 (H, W, 3) array kept as it is (no
    PIL round trip while it needs no resize). Exactly one of the two is set."""

    pil: Image.Image | None = None
    array: np.ndarray | None = None

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        return (self.pil.width, self.pil.height) if self.array is None else (self.array.shape[1], self.array.shape[0])

    def to_pil(self) -> Image.Image:
        return self.pil if self.array is None else Image.fromarray(self.array)


class ImageInputs(Protocol):
    """A family's image part as `InputProcessor` uses it: one picture to one `MMItem` (content hash, model-ready
    or compact pixels, placeholder token count and the family's `MMItem.layout`), reading and filling the pixel
    cache; and the heaviest single image a request may send, for the memory profile."""

    processor: Any
    """The family's image processor (resize, normalize ...), built from the checkpoint's preprocessor config."""

    def make_item(self, image: SourceImage, kwargs: dict, cache: PixelCache, device: str | None) -> MMItem:
        """`kwargs`: the request's mm_processor_kwargs; `device`: where the float steps run (None: the host)."""
        ...

    def profile_item(self) -> MMItem:
        ...

    def token_grid(self, item: MMItem) -> TokenGrid | None:
        """The merged grid of the item's tower output, in the raster order of its embeddings (what pruning
        strategies select on); None where the tokens form no grid."""
        ...

    # A family may also define `token_pixels(item) -> Tensor`: (tokens, F) uint8, row i the intensity levels of
    # the preprocessed pixels token i of `token_grid` covers (what dedup compares); without it, dedup is refused.
    # Optional members, read by `InputProcessor` where a family's processor has its own prompt rules (Fuyu's):
    # `max_images_per_prompt: int`, `encode_prompt(tokenizer, text, num_images) -> list[int]` (a raw prompt's ids)
    # and `placeholder_ids(item, placeholder_id) -> list[int]` (the ids one image placeholder expands to).


@dataclass
class PixelSettings:
    """The settings every family's processor shares, named as HF's preprocessor configs name them."""

    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    resample: int = BICUBIC

    @staticmethod
    def settings_from_config(d: Mapping[str, Any]) -> dict[str, Any]:
        """The PixelSettings fields of a ``preprocessor_config.json`` dict, validated."""
        return {"image_mean": rgb_triple(d, "image_mean", OPENAI_CLIP_MEAN),
                "image_std": rgb_triple(d, "image_std", OPENAI_CLIP_STD),
                "rescale_factor": float(d.get("rescale_factor", 1 / 255)),
                "do_resize": bool(d.get("do_resize", True)), "do_rescale": bool(d.get("do_rescale", True)),
                "do_normalize": bool(d.get("do_normalize", True)), "resample": int(d.get("resample", BICUBIC))}


def cached_preprocess(image: SourceImage, params: Mapping[str, Any], cache: PixelCache,
                      run: Callable[[Image.Image], tuple[Any, Any]]) -> tuple[str, Any, Any]:
    """(content hash, pixels, layout) of a picture: from the pixel cache, else `run` on its PIL image (an array
    becomes one only then: a repeat is found by the array's hash) and kept in the cache."""
    from flashvlm.processing.hashing import hash_image, hash_pixels

    array = image.array
    mm_hash = (hash_image(image.pil, params) if array is None
               else hash_pixels("RGB", array.shape[1], array.shape[0], params, array))
    cached = cache.get(mm_hash)
    if cached is not None:
        return mm_hash, *cached
    pixels, layout = run(image.to_pil())
    cache.put(mm_hash, pixels, layout)
    return mm_hash, pixels, layout


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


def to_rgb(img: Image.Image) -> Image.Image:
    return img if img.mode == "RGB" else img.convert("RGB")


def positive_int(d: Mapping[str, Any], key: str, default: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"preprocessor config: {key!r} must be a positive integer, got {v!r}")
    return v


def rgb_triple(d: Mapping[str, Any], key: str, default: Sequence[float]) -> tuple[float, ...]:
    v = d.get(key)
    if v is None:
        return tuple(default)
    v = [v] * 3 if isinstance(v, (int, float)) else list(v)
    if len(v) != 3:
        raise ValueError(f"preprocessor config: {key!r} must have 3 values (RGB), got {v!r}")
    return tuple(float(x) for x in v)


def normalize(arr: np.ndarray, proc: PixelSettings, device: torch.device | str | None) -> torch.Tensor:
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


def pixel_levels(x: torch.Tensor, proc: PixelSettings, channel_dim: int) -> torch.Tensor:
    """The uint8 intensity levels that `normalize` turned into `x` (channels along `channel_dim`): its steps
    undone and rounded, which recovers each level exactly (the float32 round trip is off by far less than 0.5)."""
    x = x.float()
    if proc.do_normalize:
        shape = [1] * x.dim()
        shape[channel_dim] = -1
        x = x * torch.tensor(proc.image_std, device=x.device).view(shape) + \
            torch.tensor(proc.image_mean, device=x.device).view(shape)
    if proc.do_rescale:
        x = x / proc.rescale_factor
    return x.round().clamp_(0, 255).to(torch.uint8)  # not in place: x may be the item's (shared) pixels


def token_blocks(image: torch.Tensor, block: int) -> torch.Tensor:
    """(H, W, C) pixels -> (H // block * W // block, block * block * C): the pixels of each block x block block, in
    raster order of the blocks (a row or column left over past the last whole block is not covered)."""
    h, w, c = image.shape
    rows, cols = h // block, w // block
    image = image[:rows * block, :cols * block]
    return image.reshape(rows, block, cols, block, c).permute(0, 2, 1, 3, 4).reshape(rows * cols, -1)


def value_table(proc: PixelSettings) -> torch.Tensor:
    """(C * 256,) float32, channel-major: what `normalize` turns each uint8 value of each channel into. The same
    elementwise float64/float32 operations on the 256 possible values, so a lookup is bit-identical to them."""
    return normalize(np.arange(256, dtype=np.uint8)[:, None].repeat(3, axis=1), proc, None).T.contiguous().flatten()


def table_on(proc: PixelSettings, device: torch.device | str) -> torch.Tensor:
    """`value_table(proc)` on `device`, made once per device and kept on the processor (outside its fields)."""
    tables = proc.__dict__.setdefault("_tables_by_device", {})
    key = str(device)
    if key not in tables:
        tables[key] = value_table(proc).to(device)
    return tables[key]


def lookup_normalize(levels: torch.Tensor, proc: PixelSettings) -> torch.Tensor:
    """uint8 (..., H, W, C) -> float32 (..., C, H, W) on levels' device: `normalize` then channels first, as one
    table lookup (bit-identical to it on the CPU, and on an accelerator too since the table is made on the CPU)."""
    c = levels.shape[-1]
    dims = levels.dim()
    # The uint8 transpose is the cheap one (a byte a value); the lookup then reads and writes in order.
    planes = levels.permute(*range(dims - 3), dims - 1, dims - 3, dims - 2).contiguous()
    offsets = torch.arange(0, 256 * c, 256, dtype=torch.int32, device=levels.device).view(c, 1, 1)
    index = (planes.to(torch.int32) + offsets).reshape(-1)
    return torch.index_select(table_on(proc, levels.device), 0, index).view(planes.shape)


def get_image_processor(preprocessor_config: Mapping[str, Any], model_type: str) -> Any:
    """The image processor of the family with this ``config.model_type``; unknown families raise ValueError."""
    from flashvlm.models.registry import family_for_model_type

    return family_for_model_type(model_type).image_processor(preprocessor_config or {})
