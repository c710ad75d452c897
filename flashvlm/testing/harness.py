"""Run a model's forward on one sequence without the engine: for component tests of model files."""

from __future__ import annotations

import torch

from flashvlm.attention.base import AttentionMetadata
from flashvlm.attention.reference import ReferenceBackend
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import KVCacheSpec


def single_sequence_prefill_context(num_tokens: int, spec: KVCacheSpec, dtype: torch.dtype,
                                    device: str | torch.device = "cpu", block_size: int = 16) -> ForwardContext:
    """A fresh KV cache holding exactly one sequence, and metadata for prefilling all its tokens at once."""
    num_blocks = (num_tokens + block_size - 1) // block_size + 1  # block 0 is the null block
    kv = [torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
          for _ in range(spec.num_layers)]
    blocks = torch.arange(1, num_blocks, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([0], dtype=torch.int32, device=device),
        block_tables=blocks[None, :],
        slot_mapping=torch.arange(block_size, block_size + num_tokens, dtype=torch.int64, device=device),
        block_size=block_size, query_start_loc_host=[0, num_tokens], seq_lens_host=[num_tokens],
        max_query_len=num_tokens, max_seq_len=num_tokens)
    return ForwardContext(attn_meta=meta, kv_caches=kv, backend=ReferenceBackend())
