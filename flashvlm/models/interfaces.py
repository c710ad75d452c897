"""The contract every model family implements; the runner talks only to this."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashvlm.layers.attention import ForwardContext
from flashvlm.request import MMItem


class MissingWeightError(ValueError):
    """The checkpoint lacks tensors the model needs; the message names them."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int


class VLModel(nn.Module):
    """Base for vision-language models.

    The runner calls, per step: `encode_images` for images scheduled for encoding, `embed_tokens`,
    then `forward` with image embeddings scattered into the text embeddings, then `compute_logits`
    on the hidden states of the rows it samples.
    """

    uses_mrope: bool = False
    image_token_id: int = -1

    def kv_cache_spec(self) -> KVCacheSpec:
        raise NotImplementedError

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        return self.language_model.embed_tokens.num_embeddings

    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        """Returns one (item.num_tokens, hidden) tensor per item, in the language model's dtype."""
        raise NotImplementedError

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """inputs_embeds (N, hidden); positions (N,) or (3, N) for M-RoPE -> hidden states (N, hidden)."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prompt_positions(self, prompt_token_ids: list[int], mm_items: list[MMItem]) -> tuple[torch.Tensor, int]:
        """Positions of the prompt tokens and the delta that continues them for generated tokens.

        Plain RoPE: (arange(L), 0). M-RoPE: a (3, L) tensor and the rope delta, so generated token i
        sits at position i + delta on all three axes."""
        return torch.arange(len(prompt_token_ids)), 0

    def load_weights(self, weights) -> set[str]:
        """Consume (checkpoint_name, tensor) pairs; return the parameter names that were filled."""
        raise NotImplementedError
