"""LLaVA-NeXT (LLaVA-1.6) in llava-hf form: LLaVA-1.5's CLIP tower, projector and decoder (`models/llava.py`), run
on a base image plus any-resolution crops, whose features are stitched back into one grid, cropped to the picture
(the padding's rows or columns dropped) and closed row by row with the learned `image_newline` embedding.

An item's tokens, in order: the base image's side x side features (CLS dropped), then for each kept feature row its
kept columns and one newline (`processing/anyres.py:AnyResLayout`, the item's layout). Mistral text models (the
1.6-Mistral checkpoints) run on the shared Llama decoder: without a sliding window the two are the same network."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.models.llava import LlavaForConditionalGeneration
from flashvlm.processing.anyres import AnyResLayout
from flashvlm.request import MMItem

_NEWLINE_NAMES = ("model.image_newline", "image_newline")


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    supported_text_models = ("llama", "mistral")

    def __init__(self, hf_config) -> None:
        strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
        if strategy != "default":
            # The tiles' features are laid out as side x side grids, which a kept CLS token would break.
            raise ValueError(f"LLaVA-NeXT takes vision_feature_select_strategy 'default', got {strategy!r}")
        text_cfg = hf_config.text_config
        window = getattr(text_cfg, "sliding_window", None)
        if window is not None and window < text_cfg.max_position_embeddings:
            raise ValueError(f"sliding-window attention (text_config.sliding_window {window}) is not supported")
        super().__init__(hf_config)
        vision_cfg = hf_config.vision_config
        self.side = vision_cfg.image_size // vision_cfg.patch_size
        """Features per tile edge."""
        self.image_newline = nn.Parameter(torch.zeros(text_cfg.hidden_size))

    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        if not items:
            return []
        shape = self.vision_tower.pixel_shape
        pixel_values = [torch.as_tensor(item.pixel_values) for item in items]
        for item, pv in zip(items, pixel_values):
            layout = item.layout
            if not isinstance(layout, AnyResLayout):
                raise ValueError(f"image {item.mm_hash}: no any-resolution layout (got {layout!r})")
            if tuple(pv.shape) != (1 + layout.num_crops, *shape):
                raise ValueError(f"image {item.mm_hash}: pixel_values shape {tuple(pv.shape)}, its layout needs "
                                 f"{(1 + layout.num_crops, *shape)} (the base image and {layout.num_crops} crops)")
            if layout.side != self.side:
                raise ValueError(f"image {item.mm_hash}: laid out for {layout.side}x{layout.side} features a tile, "
                                 f"the vision tower yields {self.side}x{self.side}")
            if item.encoder_tokens != layout.num_tokens:
                raise ValueError(f"image {item.mm_hash}: {item.encoder_tokens} placeholder tokens unpruned, "
                                 f"its layout yields {layout.num_tokens}")
        weight = self.vision_tower.embeddings.patch_embedding.weight
        pixels = torch.cat(pixel_values).to(device=weight.device, dtype=weight.dtype, non_blocking=True)
        features = self.multi_modal_projector(self.vision_tower(pixels)[:, 1:])  # every tile of every image at once
        out, start = [], 0
        for item in items:
            crops = 1 + item.layout.num_crops
            out.append(self._pack(features[start:start + crops], item.layout))
            start += crops
        return out

    def _pack(self, features: torch.Tensor, layout: AnyResLayout) -> torch.Tensor:
        """(1 + crops, side * side, D) -> the item's tokens: base features, then the kept grid row by row, each row
        closed by the newline embedding."""
        side, dim = self.side, features.shape[-1]
        grid = features[1:].view(layout.rows, layout.cols, side, side, dim).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(layout.rows * side, layout.cols * side, dim)
        grid = grid[layout.row_start:layout.row_stop, layout.col_start:layout.col_stop]
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, dim)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, dim)])

    def _param_name(self, ckpt_name: str) -> str | None:
        if ckpt_name in _NEWLINE_NAMES:
            return "image_newline"
        return super()._param_name(ckpt_name)
