"""Attention backend interface and the per-step metadata that travels with a forward pass.

A step's flat token batch holds, for each scheduled sequence, its new tokens (a prefill chunk or one
decode token) contiguously, in scheduler order. Keys and values of those tokens are first written
into the paged KV cache by slot mapping; attention then reads the whole context from the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor
    """(B+1,) int32: offsets of each sequence's new tokens in the flat batch."""
    seq_lens: torch.Tensor
    """(B,) int32: context length after this step (cached + new)."""
    block_tables: torch.Tensor
    """(B, max_blocks) int32, padded with 0."""
    slot_mapping: torch.Tensor
    """(N,) int64: cache slot (block * block_size + offset) of each new token."""
    block_size: int
    # Host copies, so backends that loop on the host never sync the device to read them.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Owns how attention reads the paged cache; one instance per engine."""

    name: str = "base"
    graph_capturable: bool = False
    """Whether a step through it can be captured in a CUDA graph (no host loops or syncs in forward)."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """kv_cache: (2, num_blocks, block_size, kv_heads, head_dim); k, v: (N, kv_heads, head_dim)."""
        key_cache = kv_cache[0].view(-1, *kv_cache.shape[-2:])
        value_cache = kv_cache[1].view(-1, *kv_cache.shape[-2:])
        key_cache.index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
        value_cache.index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: (N, heads, head_dim) -> (N, heads, head_dim); causal over each sequence's context."""


def get_backend(name: str) -> AttentionBackend:
    if name == "reference":
        from flashvlm.attention.reference import ReferenceBackend

        return ReferenceBackend()
    if name == "triton":
        from flashvlm.attention.triton_backend import TritonBackend

        return TritonBackend()
    if name == "fa4":
        from flashvlm.attention.flash_attn4 import FlashAttn4Backend

        return FlashAttn4Backend()
    raise ValueError(f"unknown attention backend {name!r} (available: reference, triton, fa4)")
