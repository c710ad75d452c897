"""The contract every model family implements; the runner talks only to this."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from flashvlm.layers.attention import ForwardContext
from flashvlm.layers.linear import GEMV_MAX_ROWS, Linear, linear
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
    vision_graphable: bool = False
    """encode_images can be captured in a CUDA graph per batch shape (no host syncs, no host-to-device copies)."""
    image_token_id: int = -1
    language_model: nn.Module
    """A models.decoder.DecoderModel; families set it (and lm_head) with init_language_model()."""
    lm_head: Linear | None
    encoder_reads_embeddings = False
    """`encode_images` reads rows of the token embedding (Fuyu's newline rows): the tensor-parallel pass then
    keeps the embedding whole on every rank instead of splitting it by vocabulary."""

    def init_language_model(self, hf_config, decoder: nn.Module) -> None:
        """Attach the text decoder and its head; tied embeddings share the embedding matrix (lm_head None)."""
        text_cfg = hf_config.text_config
        self.language_model = decoder
        # transformers copies a text-config tie flag up to the top level; read both for older configs.
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False)
                                        or getattr(text_cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else \
            Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False)
        self.use_triton_kernels = True
        """Tied heads: the Triton GEMV for few rows, as a Linear head has (the engine sets both)."""
        self.gemv_max_rows = GEMV_MAX_ROWS

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.language_model.kv_cache_spec()

    @property
    def embedding_width(self) -> int:
        """Columns of a row of `embed_tokens`, `encode_images` and `forward`'s input: the hidden size, or more
        where a family's image rows carry extra features for the decoder (Qwen3-VL's DeepStack)."""
        return self.language_model.embed_tokens.embedding_dim

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    @property
    def vocab_size(self) -> int:
        return self.language_model.embed_tokens.num_embeddings

    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        """Returns one (item.num_tokens, embedding_width) tensor per item, in the language model's dtype."""
        raise NotImplementedError

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """inputs_embeds (N, hidden); positions (N,) or (3, N) for M-RoPE -> hidden states (N, hidden)."""
        return self.language_model(inputs_embeds, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return linear(hidden, self.language_model.embed_tokens.weight, max_rows=self.gemv_max_rows,
                          enabled=self.use_triton_kernels)
        return self.lm_head(hidden)

    def prompt_positions(self, prompt_token_ids: list[int], mm_items: list[MMItem],
                         kept: Mapping[int, np.ndarray] | None = None) -> tuple[torch.Tensor, int]:
        """Positions of the prompt tokens and the delta that continues them for generated tokens.

        Plain RoPE: (arange(L), 0). M-RoPE: a (3, L) tensor and the rope delta, so generated token i
        sits at position i + delta on all three axes. A pruned item (`item.pruning`) keeps the tokens `kept[i]`
        (i: its index in mm_items; sorted indices into its full output) at the positions they have unpruned, and
        what follows it sits where it would after the whole image; items whose kept indices are not given yet
        get their first num_tokens positions, which the runner replaces before those tokens run."""
        if not any(item.pruning is not None for item in mm_items):
            return torch.arange(len(prompt_token_ids)), 0
        positions = np.arange(len(prompt_token_ids), dtype=np.int64)
        shift = 0
        for i, item in sorted(enumerate(mm_items), key=lambda pair: pair[1].offset):
            chosen = (kept or {}).get(i)
            if chosen is not None:
                positions[item.offset:item.end] = positions[item.offset] + np.asarray(chosen, dtype=np.int64)
            dropped = item.encoder_tokens - item.num_tokens
            positions[item.end:] += dropped
            shift += dropped
        return torch.from_numpy(positions), shift

    def checkpoint_module(self, ckpt_name: str) -> str | None:
        """The module (by our name) that a checkpoint tensor is loaded into; None for tensors the model skips.
        The quantization pass uses it to find the layers a pre-quantized checkpoint stores quantized."""
        raise NotImplementedError

    def load_weights(self, weights) -> set[str]:
        """Consume (checkpoint_name, tensor) pairs; return the parameter names that were filled."""
        raise NotImplementedError
