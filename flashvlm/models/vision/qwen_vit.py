"""Qwen2-VL and Qwen2.5-VL vision towers: native-resolution ViTs with 2-D rotary and a 2x2 patch merger.

Several images run in one call: their patches are concatenated and attention is block-diagonal over
images (or over windows of an image, in Qwen2.5-VL's window layers) through `varlen_attention`.
Patches arrive in the processor's merge-block order (t, h/m, w/m, m, m), so every m*m consecutive
rows form one merged token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from flashvlm.layers.linear import PlainLinear
from flashvlm.layers.mlp import GatedMLP, PlainMLP
from flashvlm.layers.norm import LayerNorm, RMSNorm
from flashvlm.layers.rotary import apply_rotary_qk_, rotate_half
from flashvlm.layers.vision_attention import varlen_attention

Grid = tuple[int, int, int]

# Qwen2.5-VL's vision MLP names its projections like the text MLP does, so it is packed the same way;
# the model file checks that this agrees with the decoder's mapping (one loader pass serves both).
QWEN_VIT_PACKED_PROJECTIONS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def vision_position_ids(grids: Sequence[Grid], merge: int, device: torch.device) -> torch.Tensor:
    """(h, w) patch coordinates of every patch, in merge-block order -> (patches, 2) long."""
    out = []
    for t, h, w in grids:
        hh = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)
        ww = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)
        # (h/m, m, w/m, m) -> (h/m, w/m, m, m): the order the processor emits patches in
        pos = torch.stack([hh.transpose(1, 2).flatten(), ww.transpose(1, 2).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def frame_cu_seqlens(grids: Sequence[Grid]) -> list[int]:
    """Full-attention segments: each frame of each image attends only to itself."""
    cu = [0]
    for t, h, w in grids:
        for _ in range(t):
            cu.append(cu[-1] + h * w)
    return cu


def window_partition(grids: Sequence[Grid], merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL window layout over merged tokens.

    `window` is the window side in merged tokens. Windows tile each frame row-major from the top-left
    corner (the last row/column of windows may be partial); inside a window merged tokens stay row-major.
    Returns the permutation of merged tokens into window order and the window boundaries in patches.
    """
    orders, cu, base, unit = [], [0], 0, merge * merge
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        nwh, nww = -(-gh // window), -(-gw // window)
        r = torch.arange(gh).view(gh, 1)
        c = torch.arange(gw).view(1, gw)
        win = (r // window) * nww + c // window  # (gh, gw) window id within a frame
        key = ((win * window + r % window) * window + c % window).flatten()
        key = key[None, :] + torch.arange(t)[:, None] * (nwh * nww * window * window)
        orders.append(torch.argsort(key.flatten()) + base)
        sizes = torch.bincount(win.flatten(), minlength=nwh * nww).repeat(t) * unit
        cu.extend((cu[-1] + sizes.cumsum(0)).tolist())
        base += t * gh * gw
    return torch.cat(orders), cu


def vision_rotary(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches, 2) positions -> float32 cos, sin (patches, head_dim): h angles, then w, twice."""
    freqs = (pos.float()[:, :, None] * inv_freq[None, None, :]).flatten(1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_vision_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # In float32 whatever the model dtype: the reference does the same, and bf16 angles drift.
    xf = x.float()
    return (xf * cos[:, None] + rotate_half(xf) * sin[:, None]).to(x.dtype)


class PatchEmbed(nn.Module):
    """The reference's Conv3d with kernel == stride over one patch is a Linear over the flattened patch."""

    def __init__(self, in_features: int, dim: int, bias: bool = False) -> None:
        super().__init__()
        self.proj = PlainLinear(in_features, dim, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"vision width {dim} not divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = PlainLinear(dim, 3 * dim, bias=True)
        self.proj = PlainLinear(dim, dim)
        self.use_triton_kernels = True
        """Fused rotary kernel on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""
        self.attention_impl = "sdpa"
        """varlen_attention's impl: "sdpa" or "fa4"; the engine sets it from EngineConfig.vision_attention."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x)
        # One launch for q and k instead of seven each: the tower runs eagerly, so launches are its host cost.
        fused = apply_rotary_qk_(qkv, cos, sin, 2 * self.num_heads, self.head_dim, enabled=self.use_triton_kernels,
                                 fp32_math=True)
        q, k, v = qkv.view(n, 3, self.num_heads, self.head_dim).unbind(1)
        if not fused:
            q, k = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin)
        return self.proj(varlen_attention(q, k, v, cu_seqlens, impl=self.attention_impl).reshape(n, -1))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, norm: Callable[[int], nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous block's MLP output, not yet added to `residual` (None in the first block, where x is
        the patch embeddings). Returns this block's MLP output and the residual stream before it; each add
        rides in the next norm's kernel."""
        h, residual = (self.norm1(x), x) if residual is None else self.norm1(x, residual)
        h, residual = self.norm2(self.attn(h, cos, sin, cu_seqlens), residual)
        return self.mlp(h), residual


class PatchMerger(nn.Module):
    """Normalizes each patch, then projects every merge x merge group of patches to one LM token."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = norm(dim)
        # A Sequential keeps the checkpoint's names (mlp.0, mlp.2); exact-erf GELU as in the reference.
        self.mlp = nn.Sequential(PlainLinear(self.hidden, self.hidden), nn.GELU(),
                                 PlainLinear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`residual`: the last block's residual stream, added to x inside the norm."""
        h = self.ln_q(x) if residual is None else self.ln_q(x, residual)[0]
        return self.mlp(h.view(-1, self.hidden))


def _layer_norm(dim: int) -> nn.Module:
    return LayerNorm(dim, eps=1e-6)


def _rms_norm(dim: int) -> nn.Module:
    return RMSNorm(dim, eps=1e-6)


class QwenVisionTower(nn.Module):
    """Shared parts of both towers.

    forward(pixel_values (patches, C*T*P*P), grids) -> (tokens, out_features), images concatenated."""

    def __init__(self, cfg, dim: int, out_dim: int, norm: Callable[[int], nn.Module],
                 make_mlp: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        self.patch_size = cfg.patch_size
        self.out_features = out_dim
        self.in_features = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.patch_embed = PatchEmbed(self.in_features, dim)
        head_dim = dim // cfg.num_heads
        theta = float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        # head_dim/4 frequencies per axis; explicit float32 so building under a bf16 default keeps them exact.
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2)
        self.register_buffer("inv_freq", 1.0 / theta ** quarter, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(dim, cfg.num_heads, norm, make_mlp())
                                    for _ in range(cfg.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, norm)

    def tokens_per_image(self, grid: Grid) -> int:
        t, h, w = grid
        return t * (h // self.merge) * (w // self.merge)

    def check_grids(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> None:
        for t, h, w in grids:
            if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
                raise ValueError(f"grid {(t, h, w)}: h and w must be positive multiples of the merge "
                                 f"size {self.merge}")
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (patches, self.in_features):
            raise ValueError(f"pixel_values of shape {tuple(pixel_values.shape)} do not match grids "
                             f"{list(grids)}: expected ({patches}, {self.in_features})")

    def load_transform(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Checkpoint name relative to the tower -> the tensor our parameter takes."""
        if name == "patch_embed.proj.weight" and tensor.dim() == 5:
            return tensor.reshape(tensor.shape[0], -1)  # Conv3d (D, C, T, P, P) -> Linear (D, C*T*P*P)
        return tensor

    def _embed(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_grids(pixel_values, grids)
        x = self.patch_embed(pixel_values.to(self.patch_embed.proj.weight.dtype))
        return x, vision_position_ids(grids, self.merge, x.device)

    def _run_blocks(self, x: torch.Tensor, pos: torch.Tensor,
                    cu_for_layer: Callable[[int], list[int]]) -> torch.Tensor:
        cos, sin = vision_rotary(pos, self.inv_freq)
        residual = None
        for i, block in enumerate(self.blocks):
            x, residual = block(x, residual, cos, sin, cu_for_layer(i))
        return self.merger(x, residual)


class Qwen2VisionTower(QwenVisionTower):
    """Qwen2-VL: LayerNorm blocks, QuickGELU MLP, full attention within each image in every layer."""

    def __init__(self, cfg) -> None:
        dim, hidden = cfg.embed_dim, int(cfg.embed_dim * cfg.mlp_ratio)
        super().__init__(cfg, dim, cfg.hidden_size, _layer_norm,
                         lambda: PlainMLP(dim, hidden, cfg.hidden_act))

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x, pos = self._embed(pixel_values, grids)
        cu = frame_cu_seqlens(grids)
        return self._run_blocks(x, pos, lambda _: cu)


class Qwen2_5VisionTower(QwenVisionTower):
    """Qwen2.5-VL: RMSNorm blocks, SwiGLU MLP, window attention except in `fullatt_block_indexes`."""

    def __init__(self, cfg) -> None:
        dim = cfg.hidden_size
        super().__init__(cfg, dim, cfg.out_hidden_size, _rms_norm,
                         lambda: GatedMLP(dim, cfg.intermediate_size, cfg.hidden_act, bias=True, pad_unaligned=True))
        self.window = cfg.window_size // self.merge // cfg.patch_size
        if self.window < 1:
            raise ValueError(f"window_size {cfg.window_size} is smaller than one merged token "
                             f"({self.merge * cfg.patch_size} pixels)")
        self.full_attention_layers = frozenset(cfg.fullatt_block_indexes)

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        x, pos = self._embed(pixel_values, grids)
        unit = self.merge * self.merge
        order, cu_windows = window_partition(grids, self.merge, self.window)
        order = order.to(x.device)
        # Reorder whole merged tokens (m*m patches each) so every window is contiguous; window order
        # keeps each image's patches together, so per-image segments still hold for full layers.
        patch_order = (order[:, None] * unit + torch.arange(unit, device=x.device)).flatten()
        x, pos = x[patch_order], pos[patch_order]
        cu_full = frame_cu_seqlens(grids)
        full = self.full_attention_layers
        merged = self._run_blocks(x, pos, lambda i: cu_full if i in full else cu_windows)
        out = torch.empty_like(merged)
        out[order] = merged  # back to raster merge-block order, matching the prompt's placeholders
        return out

