"""Fuyu: no vision encoder. Each 30x30 patch of the image is projected linearly into the Persimmon decoder's
embedding space (the checkpoint's vision_embed_tokens), one token a patch, and each row of patches ends in the
embedding of the |NEWLINE| token.

The projection runs where other families run their vision tower (`encode_images`), and its output covers the
image's whole span of the prompt, newlines included, so the encoder cache, chunked prefill and the image-aware
prefix cache treat it like any other image. The newline rows are the text embedding of the newline id, exactly
what transformers leaves at those positions."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from flashvlm.layers.linear import PlainLinear
from flashvlm.models.interfaces import VLModel
from flashvlm.models.persimmon import PersimmonModel, deinterleave_qkv
from flashvlm.models.weight_utils import load_params, module_of
from flashvlm.request import MMItem

NEWLINE_ID_ATTR = "image_newline_token_id"
"""The config attribute the family's load check sets from the tokenizer's |NEWLINE| id (Fuyu configs lack it)."""

# (checkpoint prefix, our prefix), first match wins: transformers 5 names, then the adept/fuyu-8b hub layout.
_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("language_model.model.", "language_model."),
    ("model.vision_embed_tokens.", "vision_tower.proj."),
    ("vision_embed_tokens.", "vision_tower.proj."),
)
_HEAD_PREFIXES = ("lm_head.", "language_model.lm_head.")
_QKV = ".self_attn.query_key_value."


class FuyuPatchProjection(nn.Module):
    """The "vision tower": one linear map of each flattened patch (row, column, channel) to the hidden size."""

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.proj = PlainLinear(in_features, hidden, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class FuyuForCausalLM(VLModel):
    uses_mrope = False
    encoder_reads_embeddings = True  # the newline rows of each image

    def __init__(self, hf_config) -> None:
        super().__init__()
        text_cfg = hf_config.text_config
        if getattr(text_cfg, "model_type", "persimmon") != "persimmon":
            raise ValueError(f"Fuyu text model {text_cfg.model_type!r} is not supported (supported: persimmon)")
        newline = getattr(hf_config, NEWLINE_ID_ATTR, None)
        if newline is None:
            raise ValueError(f"Fuyu config has no {NEWLINE_ID_ATTR}: load the checkpoint through read_checkpoint, "
                             "whose check takes it from the tokenizer's |NEWLINE| token")
        self.config = hf_config
        self.image_token_id = int(hf_config.image_token_id)
        self.image_newline_token_id = int(newline)
        channels = int(getattr(hf_config, "num_channels", 3))
        self.patch_features = int(hf_config.patch_size) ** 2 * channels
        self.vision_tower = FuyuPatchProjection(self.patch_features, text_cfg.hidden_size)
        self.init_language_model(hf_config, PersimmonModel(text_cfg))

    def _grid(self, item: MMItem) -> tuple[int, int]:
        if item.layout is None:
            raise ValueError(f"image {item.mm_hash}: Fuyu needs the image's (rows, cols) patch grid as its layout")
        rows, cols = (int(x) for x in item.layout)
        if item.encoder_tokens != rows * (cols + 1):
            raise ValueError(f"image {item.mm_hash}: {item.encoder_tokens} placeholder tokens, a {rows}x{cols} "
                             f"patch grid yields {rows * (cols + 1)}")
        return rows, cols

    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        if not items:
            return []
        grids = [self._grid(item) for item in items]
        weight = self.vision_tower.proj.weight
        pixels = [torch.as_tensor(item.model_pixels()) for item in items]
        for item, pv, (rows, cols) in zip(items, pixels, grids):
            if tuple(pv.shape) != (rows * cols, self.patch_features):
                raise ValueError(f"image {item.mm_hash}: pixel_values shape {tuple(pv.shape)}, a {rows}x{cols} grid "
                                 f"of patches needs ({rows * cols}, {self.patch_features})")
        patches = torch.cat(pixels).to(device=weight.device, dtype=weight.dtype, non_blocking=True)
        features = self.vision_tower(patches)
        dtype = self.language_model.embed_tokens.weight.dtype
        newline = self.language_model.embed_tokens.weight[self.image_newline_token_id]
        out = []
        for (rows, cols), emb in zip(grids, features.split([r * c for r, c in grids])):
            full = newline.expand(rows, cols + 1, newline.shape[0]).clone()
            full[:, :cols] = emb.view(rows, cols, -1).to(dtype)
            out.append(full.view(rows * (cols + 1), -1))
        return out

    def _param_name(self, ckpt_name: str) -> str | None:
        for src in _HEAD_PREFIXES:
            if ckpt_name.startswith(src):
                # A tied checkpoint may still carry a copy of the embedding; ours reads the embedding.
                return None if self.lm_head is None else "lm_head." + ckpt_name[len(src):]
        for src, dst in _PREFIXES:
            if ckpt_name.startswith(src):
                return dst + ckpt_name[len(src):]
        return None

    def _prepare(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Every per-row tensor of the fused QKV projection (weight, bias, a pre-quantized checkpoint's per-row
        scales) is reordered to q|k|v; one of another row count cannot be, and is refused rather than misread."""
        text_cfg = self.config.text_config
        heads, rows = text_cfg.num_attention_heads, 3 * text_cfg.hidden_size
        for name, tensor in weights:
            if _QKV in name and tensor.numel() > 1:
                if tensor.dim() == 0 or tensor.shape[0] != rows:
                    raise ValueError(f"checkpoint tensor {name} of shape {tuple(tensor.shape)}: its rows are not "
                                     f"the {rows} per-head interleaved q|k|v rows flashvlm reorders at load")
                tensor = deinterleave_qkv(tensor, heads)
            yield name, tensor

    def _expected_unused(self, ckpt_name: str) -> bool:
        return ckpt_name.startswith(_HEAD_PREFIXES) and self.lm_head is None

    def checkpoint_module(self, ckpt_name: str) -> str | None:
        name = self._param_name(ckpt_name)
        return None if name is None else module_of(name, {})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_params(self, self._prepare(weights), self._param_name, expected_unused=self._expected_unused)
