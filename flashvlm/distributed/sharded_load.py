"""Loading a rank's slice only: the model is built with this rank's head and MLP widths (a copy of the text
config with the local counts), and each checkpoint tensor of a decoder projection is cut to this rank's rows or
columns as it is read (a pre-quantized checkpoint's quantized tensors and scales too: prequant_shard.py), so no
rank ever holds the full language model. The embedding and LM head are built whole and split by the pass
(shard.py) after loading."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from flashvlm.config import ConfigError
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.prequant_shard import Cut, narrow_quantized
from flashvlm.distributed.shard import head_split, intermediate_rows
from flashvlm.quant.plan import QuantPlan

_PROJECTION = re.compile(r"\.layers\.\d+\.(?:self_attn\.([qkvo])_proj|mlp\.(gate|up|down)_proj)\.(\w+)$")
_VISION = ("visual.", "vision_tower.", "multi_modal_projector.")


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", hf_config)


def loads_sharded(hf_config: Any, group: TPGroup) -> bool:
    """Whether this model loads per rank: the Llama-style decoder (Persimmon's interleaved QKV loads whole)."""
    text = _text_config(hf_config)
    return group.size > 1 and getattr(text, "model_type", "") != "persimmon" and hasattr(text, "num_key_value_heads")


def check_prequantized_split(hf_config: Any, group: TPGroup, load_format: str) -> None:
    """A pre-quantized checkpoint is split as it loads: refuse the decoders that load whole, and random weights
    (which the quantize-at-load pass would round with the checkpoint's scheme)."""
    if not loads_sharded(hf_config, group):
        raise ConfigError(f"a pre-quantized {_text_config(hf_config).model_type} checkpoint with "
                          f"tensor_parallel_size {group.size}: its decoder loads whole and is split after, which "
                          "quantized layers are not (Llama-style decoders are split as they load)")
    if load_format == "dummy":
        raise ConfigError(f"random weights (load_format dummy) in a pre-quantized checkpoint's scheme with "
                          f"tensor_parallel_size {group.size}: load the checkpoint, or use --quantization on a "
                          "float checkpoint")


def local_config(hf_config: Any, group: TPGroup) -> Any:
    """A copy of `hf_config` whose text config has this rank's attention heads, KV heads and MLP width."""
    local = copy.deepcopy(hf_config)
    text = _text_config(local)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads, kv_heads = head_split(text.num_attention_heads, text.num_key_value_heads, group)
    rows = intermediate_rows(text.intermediate_size, group)
    text.head_dim = head_dim
    text.num_attention_heads, text.num_key_value_heads = len(heads), len(kv_heads)
    text.intermediate_size = rows.stop - rows.start
    return local


def narrow_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], hf_config: Any, group: TPGroup,
                      plan: QuantPlan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each decoder projection cut to this rank's share (of the full config); with
    a pre-quantized checkpoint's plan, its quantized tensors and scales too (prequant_shard.py)."""
    quantized = plan is not None and plan.prequantized
    text = _text_config(hf_config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    heads, kv_heads = head_split(text.num_attention_heads, text.num_key_value_heads, group)
    rows = intermediate_rows(text.intermediate_size, group)
    q = (heads.start * head_dim, len(heads) * head_dim)
    kv = (kv_heads.start * head_dim, len(kv_heads) * head_dim)
    mlp = (rows.start, rows.stop - rows.start)
    for name, tensor in weights:
        hit = _PROJECTION.search(name)
        if hit is None or any(part in name for part in _VISION):
            yield name, tensor
            continue
        attn, mlp_name, kind = hit.groups()
        row_parallel = attn == "o" or mlp_name == "down"
        if row_parallel:
            start, length = q if attn == "o" else mlp
        else:
            start, length = q if attn == "q" else kv if attn in ("k", "v") else mlp
        if kind not in ("weight", "bias"):
            if not quantized:
                yield name, tensor
                continue
            layer = name[: -len(kind) - 1]
            full = _full_size(text, head_dim, attn, mlp_name)
            cut = Cut(layer, row_parallel, start, length, full, group.size)
            yield name, narrow_quantized(kind, tensor, cut, plan)
        elif row_parallel:  # input columns; the bias stays whole
            yield name, tensor if kind == "bias" else tensor.narrow(1, start, length).contiguous()
        else:
            yield name, tensor.narrow(0, start, length).contiguous()


def _full_size(text: Any, head_dim: int, attn: str | None, mlp_name: str | None) -> int:
    """The projection's rows (column-parallel) or inputs (row-parallel) at tensor_parallel_size 1."""
    if mlp_name is not None:
        return text.intermediate_size
    heads = text.num_attention_heads if attn in ("q", "o") else text.num_key_value_heads
    return heads * head_dim
