"""--mm-encoder-tp-mode weights: the tensor-parallel pass over a loaded model's vision tower and projector, in the
language-model pass's style (shard.py).

Attention heads are split over ranks: QKV keeps the rows of this rank's heads of each of q, k and v
(column-parallel), the output projection the matching input columns with a sum over ranks (row-parallel). Each MLP
(fc1 / gate-up column-parallel, fc2 / down row-parallel) is split the same way, and so are the mergers' and LLaVA's
projector's two-layer MLPs. The patch embedding, the norms, the position tables and the rotary stay whole on every
rank. Every rank encodes every image of the step and ends each block with the full hidden state, so the
embeddings need no gather. Fuyu has no tower (its one patch projection stays whole)."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.config import ConfigError
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.layers import PlainRowParallelLinear, RowParallelLinear
from flashvlm.distributed.shard import column_slice, intermediate_rows, shard_gated_mlp
from flashvlm.layers.linear import Linear, MergedLinear, PlainLinear
from flashvlm.layers.mlp import GatedMLP, PlainMLP
from flashvlm.models.llava import LlavaMultiModalProjector
from flashvlm.models.vision.clip import CLIPAttention
from flashvlm.models.vision.qwen3_vit import Qwen3PatchMerger
from flashvlm.models.vision.qwen_vit import PatchMerger, VisionAttention

_TWO_LAYER_MLPS: dict[type, tuple[str, str]] = {
    Qwen3PatchMerger: ("linear_fc1", "linear_fc2"), LlavaMultiModalProjector: ("linear_1", "linear_2"),
}
"""MLP module -> (its first projection, split by output rows; its second, split by input columns); a PlainMLP
names its own."""

_NOT_VISION = ("language_model", "lm_head")


def _plain_rows(full: nn.Linear, parts: list[slice]) -> PlainLinear:
    """A PlainLinear keeping the output rows `parts` of `full`, concatenated in order."""
    index = torch.cat([torch.arange(p.start, p.stop, device=full.weight.device) for p in parts])
    new = PlainLinear(full.in_features, index.numel(), bias=full.bias is not None)
    new.to(device=full.weight.device, dtype=full.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(full.weight[index])
        if full.bias is not None:
            new.bias.copy_(full.bias[index])
    return new


def _column(full: nn.Linear, rows: slice) -> nn.Linear:
    if isinstance(full, MergedLinear):
        return column_slice(full, [rows] * len(full.out_sizes))
    if isinstance(full, PlainLinear):
        return _plain_rows(full, [rows])
    raise ConfigError(f"tensor parallelism of the vision tower: no column split for {type(full).__name__}")


def _row(full: nn.Linear, group: TPGroup, cols: slice) -> nn.Linear:
    parallel = RowParallelLinear if isinstance(full, Linear) else PlainRowParallelLinear
    return parallel(full, group, cols.start, cols.stop)


def vision_heads(num_heads: int, head_dim: int, group: TPGroup) -> slice:
    """The rows (within each of q, k, v) of this rank's vision attention heads."""
    if num_heads % group.size:
        raise ConfigError(f"mm_encoder_tp_mode 'weights': tensor_parallel_size {group.size} must divide the vision "
                          f"tower's {num_heads} attention heads (mode 'data' keeps the tower whole)")
    local = num_heads // group.size
    return slice(group.rank * local * head_dim, (group.rank + 1) * local * head_dim)


def _shard_qwen_attention(attn: VisionAttention, group: TPGroup) -> None:
    rows, dim = vision_heads(attn.num_heads, attn.head_dim, group), attn.num_heads * attn.head_dim
    attn.qkv = _plain_rows(attn.qkv, [slice(rows.start + i * dim, rows.stop + i * dim) for i in range(3)])
    attn.proj = _row(attn.proj, group, rows)
    attn.num_heads //= group.size


def _shard_clip_attention(attn: CLIPAttention, group: TPGroup) -> None:
    rows = vision_heads(attn.num_heads, attn.head_dim, group)
    attn.qkv_proj = column_slice(attn.qkv_proj, [rows, rows, rows])
    attn.out_proj = _row(attn.out_proj, group, rows)
    attn.num_heads //= group.size


def _shard_two_layer_mlp(mlp: nn.Module, names: tuple[str, str], group: TPGroup) -> None:
    first, second = (getattr(mlp, n) for n in names)
    rows = intermediate_rows(first.out_features, group)
    setattr(mlp, names[0], _column(first, rows))
    setattr(mlp, names[1], _row(second, group, rows))


def shard_vision(model: nn.Module, group: TPGroup) -> None:
    """Keep this rank's slice of `model`'s vision tower and projector (loaded whole). No-op at size 1."""
    if group.size == 1:
        return
    for name, part in model.named_children():
        if name in _NOT_VISION:
            continue
        found = sharded = 0
        for module in list(part.modules()):
            found += type(module).__name__.endswith("Attention")
            if isinstance(module, VisionAttention):
                _shard_qwen_attention(module, group)
                sharded += 1
            elif isinstance(module, CLIPAttention):
                _shard_clip_attention(module, group)
                sharded += 1
            elif isinstance(module, GatedMLP):
                shard_gated_mlp(module, group)
            elif isinstance(module, PlainMLP):
                _shard_two_layer_mlp(module, module.names, group)
            elif isinstance(module, PatchMerger):
                _shard_two_layer_mlp(module.mlp, ("0", "2"), group)
            elif type(module) in _TWO_LAYER_MLPS:
                _shard_two_layer_mlp(module, _TWO_LAYER_MLPS[type(module)], group)
        if found != sharded:
            raise ConfigError(f"mm_encoder_tp_mode 'weights' covers the Qwen-VL and CLIP towers; "
                              f"{type(model).__name__}'s {name} is not covered yet (mode 'data' runs it)")
