"""Qwen3-VL (dense): the Qwen3-VL ViT (models/vision/qwen3_vit.py) -> Qwen3 decoder (QK-norm, no QKV bias,
interleaved M-RoPE), with DeepStack.

DeepStack: the tower yields, besides each image token's embedding, one feature per selected ViT block; the
decoder adds feature i to the hidden states after its layer i, at the image's positions. Those features ride in
the same rows as the embeddings (the tower's output is (tokens, hidden * (1 + k))), so the encoder cache, the
splice of a prefill chunk's share of an image and a pruned image's kept rows carry them with no bookkeeping of
their own. The step's input embeddings are as wide (text rows hold zeros there, and adding zero changes no
value): the decoder splits them. Prompt positions and weight names follow Qwen2-VL's (models/qwen2_vl.py).
"""

from __future__ import annotations

import torch

from flashvlm.layers.attention import ForwardContext
from flashvlm.layers.rotary import MRotaryEmbedding
from flashvlm.models.decoder import DecoderModel
from flashvlm.models.qwen2_vl import Qwen2VLForConditionalGeneration
from flashvlm.models.vision.qwen3_vit import Qwen3VisionTower


class DeepStackDecoder(DecoderModel):
    """The Qwen3 decoder; its input rows carry `num_deepstack` features after the embedding."""

    def __init__(self, cfg, num_deepstack: int) -> None:
        super().__init__(cfg, qkv_bias=bool(getattr(cfg, "attention_bias", False)), mrope=True, qk_norm=True)
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 5e6))
        # transformers' Qwen3-VL interleaves the M-RoPE axes whatever the config's mrope_interleaved says.
        self.rotary = MRotaryEmbedding(self.kv_cache_spec().head_dim, {**rope, "mrope_interleaved": True})
        if num_deepstack > cfg.num_hidden_layers:
            raise ValueError(f"{num_deepstack} DeepStack features for a {cfg.num_hidden_layers}-layer decoder")
        self.num_deepstack = num_deepstack

    @property
    def input_width(self) -> int:
        return self.cfg.hidden_size * (1 + self.num_deepstack)

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        hidden, n = self.cfg.hidden_size, inputs_embeds.shape[0]
        stack = None
        h = inputs_embeds
        if inputs_embeds.shape[1] != hidden:
            if inputs_embeds.shape[1] != self.input_width:
                raise ValueError(f"input rows of width {inputs_embeds.shape[1]}; expected {hidden} or "
                                 f"{self.input_width} (with {self.num_deepstack} DeepStack features)")
            stack = inputs_embeds[:, hidden:].view(n, self.num_deepstack, hidden)
            h = inputs_embeds[:, :hidden].contiguous()
        cos, sin = self.rotary(positions, h.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, ctx)
            if stack is not None and i < self.num_deepstack:
                # The layer's output in full, then its DeepStack feature, as the reference adds them.
                h, residual = h + residual + stack[:, i], None
        return self.norm(h) if residual is None else self.norm(h, residual)[0]


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower_cls = Qwen3VisionTower
    vision_graphable = True

    def build_decoder(self, text_cfg) -> DeepStackDecoder:
        return DeepStackDecoder(text_cfg, self.visual.num_deepstack)

    @property
    def embedding_width(self) -> int:
        return self.language_model.input_width

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.language_model.embed_tokens(input_ids)
        extra = self.embedding_width - embeds.shape[1]
        return torch.cat((embeds, embeds.new_zeros(embeds.shape[0], extra)), dim=1) if extra else embeds
