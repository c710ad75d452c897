"""The tensor-parallel pass over a built, loaded model: each rank keeps its slice of the language model.

Attention heads and KV heads are split over ranks (KV heads replicated when there are fewer than ranks), QKV and
gate/up keep their rows of the local heads and columns (column-parallel, no communication), o_proj and down_proj
keep the matching input columns and sum over ranks (RowParallelLinear), the embedding and the LM head are split by
vocabulary. The vision tower is left to --mm-encoder-tp-mode: whole on every rank (data, encoder.py) or sharded
by its own pass (weights, shard_vision.py)."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.config import ConfigError
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from flashvlm.distributed.prequant_shard import quantized_row_parallel
from flashvlm.layers.linear import Linear, MergedLinear
from flashvlm.layers.mlp import GatedMLP
from flashvlm.models.decoder import DecoderAttention
from flashvlm.models.persimmon import PersimmonAttention, PersimmonMLP
from flashvlm.quant.base import QuantizedLinear


def head_split(num_heads: int, num_kv_heads: int, group: TPGroup) -> tuple[range, range]:
    """The query heads and KV heads of this rank. KV heads fewer than ranks are replicated: each rank keeps the
    one its query heads read."""
    n, r = group.size, group.rank
    if num_heads % n:
        raise ConfigError(f"tensor_parallel_size {n} must divide the model's {num_heads} attention heads")
    if num_kv_heads % n and n % num_kv_heads:
        raise ConfigError(f"tensor_parallel_size {n} must divide the model's {num_kv_heads} KV heads, or be a "
                          "multiple of it")
    local = num_heads // n
    if num_kv_heads >= n:
        kv_local = num_kv_heads // n
        return range(r * local, (r + 1) * local), range(r * kv_local, (r + 1) * kv_local)
    kv = r // (n // num_kv_heads)
    return range(r * local, (r + 1) * local), range(kv, kv + 1)


def _row_parallel(layer: nn.Module, group: TPGroup, start: int, end: int, name: str) -> nn.Module:
    """Input columns [start, end) of `layer`, summed over ranks; a pre-quantized layer holds them already."""
    if isinstance(layer, QuantizedLinear):
        return quantized_row_parallel(layer, group, start, end, name)
    return RowParallelLinear(layer, group, start, end)


def _rows(heads: range, head_dim: int) -> slice:
    return slice(heads.start * head_dim, heads.stop * head_dim)


def column_slice(full: MergedLinear, parts: list[slice]) -> MergedLinear:
    """A MergedLinear keeping, of each packed projection, the rows `parts[i]` (offsets within that projection)."""
    sizes = [p.stop - p.start for p in parts]
    new = MergedLinear(full.in_features, sizes, bias=full.bias is not None)
    new.to(device=full.weight.device, dtype=full.weight.dtype)
    new.use_triton_kernels, new.gemv_max_rows = full.use_triton_kernels, full.gemv_max_rows
    starts = [sum(full.out_sizes[:i]) for i in range(len(full.out_sizes))]
    with torch.no_grad():
        for i, (start, part) in enumerate(zip(starts, parts)):
            new.load_shard("weight", i, full.weight[start + part.start : start + part.stop])
            if full.bias is not None:
                new.load_shard("bias", i, full.bias[start + part.start : start + part.stop])
    return new


def _shard_attention(attn: DecoderAttention, group: TPGroup, part: TPGroup) -> None:
    heads, kv_heads = head_split(attn.num_heads, attn.num_kv_heads, part)
    q_rows, kv_rows = _rows(heads, attn.head_dim), _rows(kv_heads, attn.head_dim)
    if part.size > 1:
        attn.qkv_proj = column_slice(attn.qkv_proj, [q_rows, kv_rows, kv_rows])
    attn.o_proj = _row_parallel(attn.o_proj, group, q_rows.start, q_rows.stop, "o_proj")
    attn.num_heads, attn.num_kv_heads = len(heads), len(kv_heads)
    attn.attn.num_heads, attn.attn.num_kv_heads = len(heads), len(kv_heads)


def _shard_persimmon_attention(attn: PersimmonAttention, group: TPGroup) -> None:
    heads, _ = head_split(attn.num_heads, attn.num_heads, group)
    rows = _rows(heads, attn.head_dim)
    attn.query_key_value = column_slice(attn.query_key_value, [rows, rows, rows])
    attn.dense = _row_parallel(attn.dense, group, rows.start, rows.stop, "dense")
    attn.num_heads = attn.attn.num_heads = attn.attn.num_kv_heads = len(heads)


def intermediate_rows(inter: int, group: TPGroup) -> slice:
    if inter % group.size:
        raise ConfigError(f"tensor_parallel_size {group.size} must divide the intermediate size {inter}")
    local = inter // group.size
    return slice(group.rank * local, (group.rank + 1) * local)


def _shard_persimmon_mlp(mlp: PersimmonMLP, group: TPGroup) -> None:
    up = mlp.dense_h_to_4h
    rows = intermediate_rows(up.out_features, group)
    mlp.dense_h_to_4h = column_slice(_as_merged(up), [rows])
    mlp.dense_4h_to_h = _row_parallel(mlp.dense_4h_to_h, group, rows.start, rows.stop, "dense_4h_to_h")


def _as_merged(layer: Linear) -> MergedLinear:
    """A Linear seen as a MergedLinear of one projection (same parameters), for column_slice."""
    merged = MergedLinear(layer.in_features, [layer.out_features], bias=layer.bias is not None).to("meta")
    merged.weight, merged.bias = layer.weight, layer.bias
    merged.use_triton_kernels, merged.gemv_max_rows = layer.use_triton_kernels, layer.gemv_max_rows
    return merged


def shard_gated_mlp(mlp: GatedMLP, group: TPGroup, part: TPGroup | None = None) -> None:
    """gate/up keep their rows of the split width, down its columns (`part`: how gate/up are cut, see shard_model)."""
    part = group if part is None else part
    rows = intermediate_rows(mlp.gate_up_proj.out_sizes[0], part)
    if part.size > 1:
        mlp.gate_up_proj = column_slice(mlp.gate_up_proj, [rows, rows])
    mlp.down_proj = _row_parallel(mlp.down_proj, group, rows.start, rows.stop, "down_proj")


def shard_model(model: nn.Module, group: TPGroup, loaded_local: bool = False) -> None:
    """Keep this rank's slice of `model`'s language model, whose weights are loaded: in full, or (loaded_local)
    as this rank's slices already (sharded_load.py), where only the communicating layers are swapped in.
    No-op at size 1."""
    if group.size == 1:
        return
    part = TPGroup() if loaded_local else group
    """How the projections are cut: by the group, or not at all when they hold this rank's slice already."""
    lm = model.language_model
    sharded_attn = 0
    for module in list(lm.modules()):
        if isinstance(module, DecoderAttention):
            _shard_attention(module, group, part)
            sharded_attn += 1
        elif isinstance(module, PersimmonAttention):
            _shard_persimmon_attention(module, group)
            sharded_attn += 1
        elif isinstance(module, GatedMLP):
            shard_gated_mlp(module, group, part)
        elif isinstance(module, PersimmonMLP):
            _shard_persimmon_mlp(module, group)
    if sharded_attn != len(lm.layers):
        raise ConfigError(f"tensor parallelism covers the Llama-style and Persimmon decoders; "
                          f"{type(model).__name__}'s decoder is not covered yet")
    vocab = lm.embed_tokens.num_embeddings
    head: Linear | None = model.lm_head
    tied_weight = lm.embed_tokens.weight.detach()
    if isinstance(head, QuantizedLinear):
        raise ConfigError("the checkpoint stores the LM head quantized: tensor parallelism splits a float LM head")
    if not model.encoder_reads_embeddings:
        lm.embed_tokens = VocabParallelEmbedding(lm.embed_tokens, group)
    if head is None:  # tied: the head reads the embedding's rows
        model.lm_head = ParallelLMHead(tied_weight, vocab, group)
    else:
        model.lm_head = ParallelLMHead(head.weight.detach(), vocab, group, head.bias)
    if group.device_group is not None and next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()
