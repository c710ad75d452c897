"""Qwen2-VL and Qwen2.5-VL: native-resolution ViT -> patch merger -> Qwen2 decoder with M-RoPE.

The two families differ only in the vision tower; the text side, weight naming and position rules
are shared.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from flashvlm.models.decoder import PACKED_PROJECTIONS, DecoderModel
from flashvlm.models.interfaces import VLModel
from flashvlm.models.vision.qwen_vit import (
    QWEN_VIT_PACKED_PROJECTIONS,
    Grid,
    Qwen2_5VisionTower,
    Qwen2VisionTower,
    QwenVisionTower,
)
from flashvlm.models.weight_utils import load_params, module_of
from flashvlm.request import MMItem

# load_params matches packed projections by name component anywhere in a name, so the vision tower's
# packing must agree with the decoder's on every shared component (gate_proj/up_proj).
_PACKED = {**PACKED_PROJECTIONS, **QWEN_VIT_PACKED_PROJECTIONS}
if any(PACKED_PROJECTIONS.get(k, v) != v for k, v in QWEN_VIT_PACKED_PROJECTIONS.items()):
    raise RuntimeError("Qwen ViT and decoder packed projections disagree")

# (checkpoint prefix, our prefix), first match wins: transformers >= 4.52 names (model.visual.*,
# model.language_model.*) and the older ones most hub checkpoints still carry (visual.*, model.*).
_PREFIXES = (
    ("model.visual.", "visual."),
    ("visual.", "visual."),
    ("model.language_model.", "language_model."),
    ("model.", "language_model."),
)


def _token_id(cfg, name: str) -> int:
    value = getattr(cfg, name, None)
    if value is None:
        value = getattr(getattr(cfg, "text_config", None), name, None)
    if value is None:
        raise ValueError(f"Qwen-VL config has no {name}")
    return int(value)


def mrope_positions(length: int, images: list[tuple[int, int, int, int, int, str]],
                    kept: Mapping[int, np.ndarray] | None = None) -> tuple[torch.Tensor, int]:
    """(3, length) int64 M-RoPE positions and the rope delta, for images given as (offset, end, t, merged h,
    merged w, name) (see Qwen2VLForConditionalGeneration.prompt_positions; the demo trainer uses it to spare
    transformers' per-row position loop). Built with numpy: it runs on the host before a request's first
    step, where a dozen small torch ops cost ~0.25 ms.

    A pruned image (end - offset below t * h * w) holds the tokens `kept[offset]` (sorted raster indices) of its
    grid, each at its own (t, h, w) position; the text after it continues as it would after the whole image, so
    text positions never depend on which tokens were kept. Without its kept indices (not chosen yet) its first
    end - offset raster positions stand in: the runner replaces them before the image's tokens run.

    An entry may add (frame index, time interval): a video's frame after its first continues the video's run, its
    temporal position base + index * interval, its spatial ones the first frame's (transformers' video grid)."""
    positions = np.empty((3, length), dtype=np.int64)
    cursor, pos, base = 0, 0, 0
    for entry in sorted(images):
        offset, end, t, gh, gw, name = entry[:6]
        frame, interval = entry[6:8] if len(entry) > 6 else (0, 1)
        if offset < cursor or end > length or end - offset > t * gh * gw:
            raise ValueError(f"image {name}: placeholders [{offset}, {end}) overlap another image, run past "
                             f"the prompt ({length} tokens) or outnumber its {t}x{gh}x{gw} grid")
        if frame and offset != cursor:
            raise ValueError(f"video frame {name}: frame {frame} does not follow the previous frame")
        positions[:, cursor:offset] = np.arange(pos, pos + offset - cursor)
        pos += offset - cursor
        if not frame:  # an image, or a video's first frame: later frames share its spatial start
            base = pos
        grid = np.empty((3, t, gh, gw), dtype=np.int64)
        grid[0] = base + (frame + np.arange(t)[:, None, None]) * interval
        grid[1] = base + np.arange(gh)[None, :, None]
        grid[2] = base + np.arange(gw)[None, None, :]
        grid = grid.reshape(3, -1)
        chosen = kept.get(offset) if kept is not None else None
        if chosen is not None and len(chosen) != end - offset:
            raise ValueError(f"image {name}: {len(chosen)} kept indices for {end - offset} placeholders")
        positions[:, offset:end] = grid[:, :end - offset] if chosen is None else grid[:, chosen]
        pos = base + max(gh, gw)
        cursor = end
    positions[:, cursor:] = np.arange(pos, pos + length - cursor)
    # Generated tokens continue from the position after the prompt's last one, as transformers' generate steps
    # position_ids (and its get_rope_index over prompt + output agrees). For images that is also the largest
    # position + 1, whichever tokens a pruned image kept; a video's time axis can run past it.
    return torch.from_numpy(positions), pos - cursor


class Qwen2VLForConditionalGeneration(VLModel):
    uses_mrope = True
    vision_graphable = True
    vision_tower_cls: type[QwenVisionTower] = Qwen2VisionTower

    def __init__(self, hf_config) -> None:
        super().__init__()
        text_cfg, vision_cfg = hf_config.text_config, hf_config.vision_config
        self.config = hf_config
        self.image_token_id = _token_id(hf_config, "image_token_id")
        self.vision_start_token_id = _token_id(hf_config, "vision_start_token_id")
        self.spatial_merge_size = int(vision_cfg.spatial_merge_size)
        self.visual = self.vision_tower_cls(vision_cfg)
        if self.visual.out_features != text_cfg.hidden_size:
            raise ValueError(f"vision tower yields {self.visual.out_features}-wide tokens, "
                             f"the language model is {text_cfg.hidden_size} wide")
        self.init_language_model(hf_config, self.build_decoder(text_cfg))

    def build_decoder(self, text_cfg) -> DecoderModel:
        """The text decoder (built after the tower, which a subclass's decoder may read)."""
        return DecoderModel(text_cfg, qkv_bias=True, mrope=True)

    def _grid(self, item: MMItem) -> Grid:
        if item.layout is None:
            raise ValueError(f"image {item.mm_hash}: Qwen-VL needs the image's (t, h, w) grid as its layout")
        t, h, w = (int(x) for x in item.layout)
        grid = (t, h, w)
        expected = self.visual.tokens_per_image(grid)
        if item.encoder_tokens != expected:
            raise ValueError(f"image {item.mm_hash}: {item.encoder_tokens} placeholder tokens unpruned, "
                             f"grid {grid} yields {expected}")
        return grid

    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        if not items:
            return []
        grids = [self._grid(item) for item in items]
        weight = self.visual.patch_embed.proj.weight
        # The runner hands over device floats; other callers' compact images are finished here, where they are.
        pixels = torch.cat([torch.as_tensor(item.model_pixels()) for item in items])
        pixels = pixels.to(device=weight.device, dtype=weight.dtype, non_blocking=True)
        features = self.visual(pixels, grids)
        return list(features.split([item.encoder_tokens for item in items]))

    def prompt_positions(self, prompt_token_ids: list[int], mm_items: list[MMItem],
                         kept: Mapping[int, np.ndarray] | None = None) -> tuple[torch.Tensor, int]:
        """M-RoPE positions as transformers' get_rope_index computes them for images.

        Text advances all three axes together. An image's tokens take (t, h, w) coordinates over its
        merged grid, each axis offset by the position after the preceding text; the text after it
        resumes at that offset + max(grid h, grid w). A video's frames (one item per temporal patch) form one
        run, their temporal axis stepping by the layout's interval (Qwen2.5-VL's tokens_per_second *
        second_per_grid_t). A pruned item's kept tokens keep their own positions (`kept`: item
        index -> its kept indices; see `mrope_positions`)."""
        images = []
        for item in mm_items:
            t, h, w = self._grid(item)
            frame = () if item.frame is None else item.frame  # a video's temporal patch: (index, interval)
            images.append((item.offset, item.end, t, h // self.spatial_merge_size, w // self.spatial_merge_size,
                           item.mm_hash, *frame))
        by_offset = {mm_items[i].offset: indices for i, indices in (kept or {}).items()}
        return mrope_positions(len(prompt_token_ids), images, by_offset)

    def _param_name(self, ckpt_name: str) -> str | None:
        if ckpt_name.startswith("lm_head."):
            # A tied checkpoint may still carry a copy of the embedding; ours reads the embedding.
            return None if self.lm_head is None else ckpt_name
        for src, dst in _PREFIXES:
            if ckpt_name.startswith(src):
                return dst + ckpt_name[len(src):]
        return None

    def _prepare(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            target = self._param_name(name)
            if target is not None and target.startswith("visual."):
                tensor = self.visual.load_transform(target[len("visual."):], tensor)
            yield name, tensor

    def _expected_unused(self, ckpt_name: str) -> bool:
        """What _param_name skips on purpose (anything else it cannot place is worth a warning)."""
        return ckpt_name.startswith("lm_head.") and self.lm_head is None

    def checkpoint_module(self, ckpt_name: str) -> str | None:
        name = self._param_name(ckpt_name)
        return None if name is None else module_of(name, _PACKED)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_params(self, self._prepare(weights), self._param_name, packed=_PACKED,
                           expected_unused=self._expected_unused)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower_cls = Qwen2_5VisionTower
    vision_graphable = False  # window_partition builds its permutation on the host and copies it over
