"""Attention backend interface, the backend-neutral description of a step, and the per-step metadata.

A step's flat token batch holds, for each scheduled sequence, its new tokens (a prefill chunk or one
decode token) contiguously, in scheduler order. Keys and values of those tokens are first written
into the paged KV cache by slot mapping; attention then reads the whole context from the cache.

The runner's input builder describes a step once, as an `AttentionStep`; each backend turns it into the
metadata its forward reads (`build_metadata`). Under CUDA graphs a backend also provides the fixed buffers a
graph captures (`graph_buffers`, `graph_metadata`) and fills them at replay (`fill_graph_buffers`).
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from flashvlm.attention.kv_quant import is_fp8, quantize_kv, require_scales, scatter_into


@dataclass
class AttentionStep:
    """Backend-neutral layout of one step, from the runner's input builder (device tensors, moved at once)."""

    query_start_loc: torch.Tensor
    """(B+1,) int32: offsets of each sequence's new tokens in the flat batch."""
    seq_lens: torch.Tensor
    """(B,) int32: context length after this step (cached + new)."""
    block_tables: torch.Tensor
    """(B, max_blocks) int32, padded with 0."""
    slot_mapping: torch.Tensor
    """(N,) int64: cache slot (block * block_size + offset) of each new token."""
    block_size: int
    query_start_loc_host: list[int] | None
    seq_lens_host: list[int] | None
    """Host copies of the two above as the builder computed them (no device read). None in metadata where a
    backend never reads them (the graph-capturable backends, and every captured step, unknown at capture)."""
    max_query_len: int
    """Bound on any sequence's new tokens (exact on eager steps; the bucket's token count under graphs)."""
    max_seq_len: int
    """Bound on any sequence's context (exact on eager steps; max_model_len under graphs)."""
    slot_bias: torch.Tensor | None = None
    """(num_blocks * block_size,) float32 or None: a logit bias on every key of the cache by slot (proportional
    attention over pruned images' kept tokens), added by every backend; `write_key_bias` fills it each step."""

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


_STEP_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionStep))


@dataclass
class AttentionMetadata(AttentionStep):
    """What the paged backends' forward reads: the step's layout as the backend keeps it."""

    @classmethod
    def of(cls, step: AttentionStep, **changes: object) -> AttentionMetadata:
        """The step's fields, with `changes` (field=value) applied; no tensor is copied."""
        values = {name: getattr(step, name) for name in _STEP_FIELDS}
        return cls(**(values | changes))

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class GraphAttentionBuffers:
    """The fixed device tensors a captured step reads its attention inputs from, sized for the largest graph."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int


class AttentionBackend(ABC):
    """Owns how attention reads the paged cache and what metadata it needs; one instance per engine."""

    name: str = "base"
    graph_capturable: bool = False
    """Whether a step through it can be captured in a CUDA graph (no host loops or syncs in forward)."""

    def build_metadata(self, step: AttentionStep) -> AttentionMetadata:
        """This backend's metadata for an eager step."""
        return AttentionMetadata.of(step)

    # ---- CUDA-graph hooks (capturable backends) ------------------------------------------------
    def graph_buffers(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int,
                      device: torch.device) -> GraphAttentionBuffers:
        """Fixed buffers for graphs of up to max_tokens tokens in max_seqs sequences, every row padding: slot -1
        (no KV write), length 0 and no new tokens (no attention work)."""
        return GraphAttentionBuffers(
            query_start_loc=torch.zeros(max_seqs + 1, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(max_seqs, dtype=torch.int32, device=device),
            block_tables=torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device),
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.long, device=device), block_size=block_size)

    def graph_metadata(self, buffers: GraphAttentionBuffers, num_tokens: int, num_seqs: int, max_query_len: int,
                       max_seq_len: int) -> AttentionMetadata:
        """The metadata a graph of num_tokens tokens in num_seqs sequences captures: views of the buffers, and
        host bounds that hold for every step the graph will replay (no host copies: unknown at capture)."""
        if not self.graph_capturable:
            raise RuntimeError(f"the {self.name!r} attention backend cannot be captured in a CUDA graph")
        return AttentionMetadata(
            query_start_loc=buffers.query_start_loc[: num_seqs + 1], seq_lens=buffers.seq_lens[:num_seqs],
            block_tables=buffers.block_tables[:num_seqs], slot_mapping=buffers.slot_mapping[:num_tokens],
            block_size=buffers.block_size, query_start_loc_host=None, seq_lens_host=None, max_query_len=max_query_len,
            max_seq_len=max_seq_len)

    def fill_graph_buffers(self, buffers: GraphAttentionBuffers, step: AttentionStep, num_tokens: int,
                           num_seqs: int) -> None:
        """Copy an eager step into the buffers of a graph of (num_tokens, num_seqs), padding the rest: padding
        tokens get slot -1, padding sequences no new tokens and length 0. Device-to-device copies only."""
        n, b = step.slot_mapping.shape[0], step.num_seqs
        buffers.slot_mapping[:n].copy_(step.slot_mapping)
        buffers.slot_mapping[n:num_tokens].fill_(-1)
        buffers.query_start_loc[: b + 1].copy_(step.query_start_loc)
        buffers.query_start_loc[b + 1: num_seqs + 1].fill_(n)
        buffers.seq_lens[:b].copy_(step.seq_lens)
        buffers.seq_lens[b:num_seqs].zero_()
        width = step.block_tables.shape[1]
        buffers.block_tables[:b, :width].copy_(step.block_tables)

    def reset_graph_buffers(self, buffers: GraphAttentionBuffers) -> None:
        """Before capture: every row padding (nothing written, nothing read)."""
        buffers.slot_mapping.fill_(-1)
        buffers.seq_lens.zero_()

    # ---- the op --------------------------------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        """kv_cache: (2, num_blocks, block_size, kv_heads, head_dim); k, v: (N, kv_heads, head_dim). An FP8 cache
        stores k / k_scale and v / v_scale (1-element float32 tensors, the layer's); other caches ignore them."""
        key_cache = kv_cache[0].view(-1, *kv_cache.shape[-2:])
        value_cache = kv_cache[1].view(-1, *kv_cache.shape[-2:])
        if is_fp8(kv_cache):
            k_scale, v_scale = require_scales(k_scale, v_scale)
            k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
        scatter_into(key_cache, meta.slot_mapping, k.to(kv_cache.dtype))
        scatter_into(value_cache, meta.slot_mapping, v.to(kv_cache.dtype))

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        """q: (N, heads, head_dim) -> (N, heads, head_dim); causal over each sequence's context. An FP8 cache is
        read as its stored values times k_scale / v_scale."""


def write_key_bias(slot_bias: torch.Tensor, slot_mapping: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """Store the key bias of a step's new tokens (None: 0 each, as for text) in their cache slots, once a step for
    every layer: a slot a freed block left behind gets its new owner's bias. A graph's padding tokens (slot -1)
    write their zeros into slot 0, in the null block, which no sequence reads."""
    slots = slot_mapping.clamp_min(0)
    if bias is None:
        slot_bias.index_fill_(0, slots, 0.0)
    else:
        slot_bias.index_copy_(0, slots, bias)


ATTENTION_BACKENDS: dict[str, str] = {
    "reference": "flashvlm.attention.reference:ReferenceBackend",
    "triton": "flashvlm.attention.triton_backend:TritonBackend",
    "fa4": "flashvlm.attention.flash_attn4:FlashAttn4Backend",
}
"""Language-model attention backends by name ("module:class", imported when chosen: only the chosen backend's
kernels load). The names are EngineConfig.attention_backend's values."""


def get_backend(name: str) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (available: {', '.join(ATTENTION_BACKENDS)})")
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
