"""The Persimmon decoder (Fuyu's language model): LayerNorm blocks, one fused QKV projection with biases whose
checkpoint rows interleave q, k and v per head, LayerNorm on each query and key head, rotary on part of each head,
and a squared-ReLU MLP with biases. No grouped KV heads."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.layers.activation import get_activation
from flashvlm.layers.attention import ForwardContext, PagedAttention
from flashvlm.layers.linear import Linear, MergedLinear
from flashvlm.layers.norm import HeadLayerNorm, LayerNorm
from flashvlm.layers.rotary import RotaryEmbedding, apply_head_norm_rotary_, apply_partial_rotary_
from flashvlm.models.decoder import PreNormLayer, run_decoder_layers
from flashvlm.models.interfaces import KVCacheSpec


def _head_dim(cfg) -> int:
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(f"hidden_size {cfg.hidden_size} is not divisible by {cfg.num_attention_heads} heads")
    return cfg.hidden_size // cfg.num_attention_heads


def rotary_dim(cfg) -> int:
    """Channels of each head that rotate: head_dim * partial_rotary_factor (transformers 5 keeps the factor in
    rope_parameters, older configs at the top level)."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 0.5))
    dim = int(_head_dim(cfg) * float(factor))
    if dim <= 0 or dim % 2:
        raise ValueError(f"partial_rotary_factor {factor} gives {dim} rotary channels; need a positive even number")
    return dim


def deinterleave_qkv(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A checkpoint's query_key_value weight or bias, rows ordered (head, q|k|v, channel), reordered to
    (q|k|v, head, channel): queries, keys and values each contiguous, as the attention op takes them."""
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, 3, -1, *rest).transpose(0, 1).reshape(tensor.shape).contiguous()


class PersimmonAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, _head_dim(cfg)
        self.query_key_value = MergedLinear(hidden, [hidden, hidden, hidden], bias=True)
        """Loaded from the checkpoint's interleaved rows through `deinterleave_qkv`."""
        self.dense = Linear(hidden, hidden, bias=True)
        self.qk_layernorm = bool(getattr(cfg, "qk_layernorm", True))
        if self.qk_layernorm:
            self.q_layernorm = HeadLayerNorm(self.head_dim, cfg.layer_norm_eps)
            self.k_layernorm = HeadLayerNorm(self.head_dim, cfg.layer_norm_eps)
        self.attn = PagedAttention(self.num_heads, self.num_heads, self.head_dim, layer_idx)
        self.use_triton_kernels = True
        """Fused partial rotary on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.query_key_value(x)
        # On CUDA one launch normalizes and rotates every query and key head in place in the packed projection.
        if self.qk_layernorm and apply_head_norm_rotary_(qkv, cos, sin, self.num_heads, self.head_dim,
                                                         self.q_layernorm, self.k_layernorm,
                                                         enabled=self.use_triton_kernels):
            q, k, v = self.query_key_value.split_output(qkv)
            return self.dense(self.attn(q, k, v, ctx))
        q, k, v = self.query_key_value.split_output(qkv)
        if self.qk_layernorm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        # In place on the kernel path: q and k are the QK-norm's fresh outputs, or views of this layer's projection.
        q = apply_partial_rotary_(q, cos, sin, self.num_heads, self.head_dim, enabled=self.use_triton_kernels)
        k = apply_partial_rotary_(k, cos, sin, self.num_heads, self.head_dim, enabled=self.use_triton_kernels)
        return self.dense(self.attn(q, k, v, ctx))


class PersimmonMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.dense_h_to_4h = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.act = get_activation(cfg.hidden_act)
        self.dense_4h_to_h = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class PersimmonDecoderLayer(PreNormLayer):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.self_attn = PersimmonAttention(cfg, layer_idx)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        self.mlp = PersimmonMLP(cfg)


class PersimmonModel(nn.Module):
    """Embedding, decoder layers and final LayerNorm; `forward` takes embeddings so images can be spliced in."""

    def __init__(self, cfg) -> None:
        super().__init__()
        if getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) != cfg.num_attention_heads:
            raise ValueError("Persimmon has no grouped KV heads (num_key_value_heads must equal num_attention_heads)")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(PersimmonDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_layernorm = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps)
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 25000.0))
        self.rotary = RotaryEmbedding(rotary_dim(cfg), rope)

    def kv_cache_spec(self) -> KVCacheSpec:
        # This rank's heads: the tensor-parallel pass leaves each layer its share.
        return KVCacheSpec(self.cfg.num_hidden_layers, self.layers[0].self_attn.num_heads, _head_dim(self.cfg))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return run_decoder_layers(self.layers, self.rotary, self.final_layernorm, inputs_embeds, positions, ctx)
