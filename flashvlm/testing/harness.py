"""Run a model's forward on one sequence without the engine: for component tests of model files."""

from __future__ import annotations

import torch

from flashvlm.attention.reference import ReferenceBackend
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import KVCacheSpec
from flashvlm.runner.inputs import single_sequence_context


def single_sequence_prefill_context(num_tokens: int, spec: KVCacheSpec, dtype: torch.dtype,
                                    device: str | torch.device = "cpu", block_size: int = 16) -> ForwardContext:
    """A fresh KV cache holding exactly one sequence, prefilled at once through the reference backend."""
    return single_sequence_context(num_tokens, spec, dtype, device, block_size, ReferenceBackend())
