"""Qwen3-VL vision tower: the Qwen2-VL ViT layout (2-D rotary, full attention within each frame, 2x2 merge) with
16-pixel patches, a learned position table resampled to each image's grid, and DeepStack: the hidden states after
selected blocks go through their own mergers, and the language model adds those features to its first layers'
hidden states at the image's positions.

The tower returns one tensor per call, (tokens, out_dim * (1 + deepstack layers)): the main merger's tokens, then
each DeepStack feature in the order the blocks produce them, side by side. One row per merged token keeps a
token's DeepStack features with it wherever its embedding goes (the encoder cache, a prefill chunk's share of an
image, the rows a pruning strategy keeps)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from flashvlm.layers.linear import PlainLinear
from flashvlm.layers.mlp import PlainMLP
from flashvlm.layers.norm import LayerNorm
from flashvlm.models.vision.qwen_vit import (
    Grid,
    PatchEmbed,
    QwenVisionTower,
    frame_cu_seqlens,
    vision_rotary,
)


def _layer_norm(dim: int) -> nn.Module:
    return LayerNorm(dim, eps=1e-6)


def _axis_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into a `side`-long table for each of `size` target positions: (size, 2)
    indices and (size, 2) float32 weights."""
    src = torch.arange(size, device=device, dtype=torch.float32) * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    offsets = torch.arange(2, device=device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_taps(grids: Sequence[Grid], merge: int, side: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The four (row, column) taps of the `side` x `side` learned position table that each patch's position
    embedding is interpolated from, and their weights: (patches, 4) long, (patches, 4) float32, in the
    processor's merge-block patch order. Built on the device from sizes alone (no host copy), so the tower
    stays capturable in a CUDA graph."""
    indices, weights = [], []
    for t, h, w in grids:
        rows, row_w = _axis_taps(h, side, device)
        cols, col_w = _axis_taps(w, side, device)
        idx = (rows[:, None, :, None] * side + cols[None, :, None, :]).reshape(h, w, 4)
        wts = (row_w[:, None, :, None] * col_w[None, :, None, :]).reshape(h, w, 4)
        # raster (h, w) -> merge blocks (h/m, w/m, m, m), the order the patches arrive in
        idx = idx.view(h // merge, merge, w // merge, merge, 4).transpose(1, 2).reshape(-1, 4)
        wts = wts.view(h // merge, merge, w // merge, merge, 4).transpose(1, 2).reshape(-1, 4)
        indices.append(idx.repeat(t, 1))
        weights.append(wts.repeat(t, 1))
    return torch.cat(indices), torch.cat(weights)


class Qwen3PatchMerger(nn.Module):
    """merge x merge patches -> one LM token. The main merger normalizes each patch before grouping them; the
    DeepStack mergers normalize the grouped vector ("post-shuffle")."""

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = _layer_norm(self.hidden if postshuffle else dim)
        self.linear_fc1 = PlainLinear(self.hidden, self.hidden)
        self.act = nn.GELU()  # exact erf, as the reference's merger
        self.linear_fc2 = PlainLinear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual`: the block's residual stream, added to x (inside the norm where it can be)."""
        if self.postshuffle:
            full = x if residual is None else x + residual
            h = self.norm(full.reshape(-1, self.hidden))
        else:
            h = (self.norm(x) if residual is None else self.norm(x, residual)[0]).reshape(-1, self.hidden)
        return self.linear_fc2(self.act(self.linear_fc1(h)))


class Qwen3VisionTower(QwenVisionTower):
    """LayerNorm blocks, a plain (ungated) MLP, full attention within each frame in every block."""

    def __init__(self, cfg) -> None:
        dim = cfg.hidden_size
        super().__init__(cfg, dim, cfg.out_hidden_size, _layer_norm,
                         lambda: PlainMLP(dim, cfg.intermediate_size, cfg.hidden_act,
                                          names=("linear_fc1", "linear_fc2")))
        self.patch_embed = PatchEmbed(self.in_features, dim, bias=True)
        self.merger = Qwen3PatchMerger(dim, cfg.out_hidden_size, self.merge, postshuffle=False)
        self.side = math.isqrt(cfg.num_position_embeddings)
        if self.side * self.side != cfg.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {cfg.num_position_embeddings} is not a square grid")
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, dim)
        layers = [int(i) for i in cfg.deepstack_visual_indexes]
        if any(not 0 <= i < cfg.depth for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"deepstack_visual_indexes {layers} must be distinct blocks of the {cfg.depth}")
        self._deepstack_slot = {layer: j for j, layer in enumerate(layers)}
        """block index -> its merger in deepstack_merger_list (the checkpoint's order)."""
        self.num_deepstack = len(layers)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(dim, cfg.out_hidden_size, self.merge, postshuffle=True) for _ in layers)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x, pos = self._embed(pixel_values, grids)
        indices, weights = position_taps(grids, self.merge, self.side, x.device)
        x = x + (self.pos_embed(indices) * weights[:, :, None]).sum(1).to(x.dtype)
        cos, sin = vision_rotary(pos, self.inv_freq)
        cu = frame_cu_seqlens(grids)
        residual, stack = None, []
        for i, block in enumerate(self.blocks):
            x, residual = block(x, residual, cos, sin, cu)
            slot = self._deepstack_slot.get(i)
            if slot is not None:
                stack.append(self.deepstack_merger_list[slot](x, residual))
        return torch.cat([self.merger(x, residual), *stack], dim=1)
