"""Loading a rank's slice only: the model is built with this rank's head and MLP widths (a copy of the text
config with the local counts), and each checkpoint tensor of a decoder projection is cut to this rank's rows or
columns as it is read, so no rank ever holds the full language model. The embedding and LM head are built whole
and split by the pass (shard.py) after loading."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.shard import head_split, intermediate_rows

_PROJECTION = re.compile(r"\.layers\.\d+\.(?:self_attn\.([qkvo])_proj|mlp\.(gate|up|down)_proj)\.(weight|bias)$")
_VISION = ("visual.", "vision_tower.", "multi_modal_projector.")


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", hf_config)


def loads_sharded(hf_config: Any, group: TPGroup) -> bool:
    """Whether this model loads per rank: the Llama-style decoder (Persimmon's interleaved QKV loads whole)."""
    text = _text_config(hf_config)
    return group.size > 1 and getattr(text, "model_type", "") != "persimmon" and hasattr(text, "num_key_value_heads")


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


def narrow_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], hf_config: Any,
                      group: TPGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each decoder projection cut to this rank's share (of the full config)."""
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
        if attn == "o" or mlp_name == "down":  # row-parallel: input columns; the bias stays whole
            start, length = q if attn == "o" else mlp
            yield name, tensor if kind == "bias" else tensor.narrow(1, start, length).contiguous()
        else:
            start, length = q if attn == "q" else kv if attn in ("k", "v") else mlp
            yield name, tensor.narrow(0, start, length).contiguous()
