"""CLIP vision transformer as LLaVA uses it: a feature extractor that returns the hidden states of
chosen encoder layers, building and running only the layers those features depend on."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashvlm.layers.linear import MergedLinear, PlainLinear
from flashvlm.layers.mlp import PlainMLP

# Checkpoint projection -> (packed module, shard). Same naming as the decoder's q/k/v packing, so one
# loader pass can serve both towers without misrouting either.
CLIP_PACKED_PROJECTIONS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
}

_LAYER_RE = re.compile(r"^encoder\.layers\.(\d+)\.")


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.image_size, self.patch_size = cfg.image_size, cfg.patch_size
        self.num_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.class_embedding = nn.Parameter(torch.zeros(dim))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, dim, cfg.patch_size, stride=cfg.patch_size,
                                         bias=False)
        self.position_embedding = nn.Embedding(self.num_patches + 1, dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, 1 + patches, dim), CLS first."""
        b, _, h, w = pixel_values.shape
        if h != self.image_size or w != self.image_size:
            # Position embeddings are learned for one grid; interpolating them is not supported.
            raise ValueError(f"CLIP vision tower expects {self.image_size}x{self.image_size} images, "
                             f"got {h}x{w} (resize/crop in preprocessing)")
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(b, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = dim // self.num_heads
        if self.head_dim * self.num_heads != dim:
            raise ValueError(f"hidden_size {dim} not divisible by num_attention_heads {self.num_heads}")
        self.qkv_proj = MergedLinear(dim, [dim, dim, dim], bias=True)
        self.out_proj = PlainLinear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # (3, B, heads, S, head_dim): every image has the same length, so one dense SDPA covers the batch.
        qkv = self.qkv_proj(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.out_proj(o.transpose(1, 2).reshape(b, s, -1))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = PlainMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    """Holds the layers under `encoder.layers` so parameter names match the checkpoint's."""

    def __init__(self, cfg, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(num_layers))


def resolve_feature_layers(feature_layer: int | Sequence[int], num_hidden_layers: int) -> list[int]:
    """Map HF `vision_feature_layer` (index into hidden_states = [embeddings, layer 1, ..., layer L],
    negative from the end) to non-negative indices in that list."""
    requested = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    if not requested:
        raise ValueError("vision_feature_layer must name at least one layer")
    total = num_hidden_layers + 1
    resolved = []
    for idx in requested:
        if not -total <= idx < total:
            raise ValueError(f"vision_feature_layer {idx} out of range for a "
                             f"{num_hidden_layers}-layer vision tower")
        resolved.append(idx % total)
    return resolved


class CLIPVisionTower(nn.Module):
    """pixel_values (B, C, H, W) -> features (B, 1 + patches, hidden * len(feature layers)), CLS first.

    Layers past the deepest requested feature layer are never built (their checkpoint tensors are
    skipped), and neither is the post-layernorm, which only feeds CLIP's pooled output."""

    def __init__(self, cfg, feature_layer: int | Sequence[int] = -2) -> None:
        super().__init__()
        self.feature_layers = resolve_feature_layers(feature_layer, cfg.num_hidden_layers)
        self.hidden_size = cfg.hidden_size
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.encoder = CLIPEncoder(cfg, max(self.feature_layers))

    @property
    def num_patches(self) -> int:
        return self.embeddings.num_patches

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one input image."""
        emb = self.embeddings
        return (emb.patch_embedding.in_channels, emb.image_size, emb.image_size)

    @property
    def out_features(self) -> int:
        return self.hidden_size * len(self.feature_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        dtype = self.embeddings.patch_embedding.weight.dtype
        h = self.pre_layrnorm(self.embeddings(pixel_values.to(dtype)))
        wanted = set(self.feature_layers)
        saved: dict[int, torch.Tensor] = {0: h} if 0 in wanted else {}
        for i, layer in enumerate(self.encoder.layers, start=1):
            h = layer(h)
            if i in wanted:
                saved[i] = h
        if len(self.feature_layers) == 1:
            return saved[self.feature_layers[0]]
        return torch.cat([saved[i] for i in self.feature_layers], dim=-1)

    def param_name(self, ckpt_name: str) -> str | None:
        """Checkpoint name relative to the tower (`vision_model.` prefix optional) -> parameter name,
        or None for tensors this tower does not use."""
        name = ckpt_name.removeprefix("vision_model.")
        if name.startswith("post_layernorm.") or name.endswith("position_ids"):
            return None
        m = _LAYER_RE.match(name)
        if m is not None and int(m.group(1)) >= len(self.encoder.layers):
            return None
        return name
