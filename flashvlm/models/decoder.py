"""The Llama-style decoder shared by Qwen2 (QKV bias, M-RoPE), Qwen3 (QK-norm, interleaved M-RoPE) and Llama (no
bias, 1-D RoPE)."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.layers.attention import ForwardContext, PagedAttention
from flashvlm.layers.linear import Linear, MergedLinear
from flashvlm.layers.mlp import GatedMLP
from flashvlm.layers.norm import RMSNorm
from flashvlm.layers.rotary import MRotaryEmbedding, QKNorm, RotaryEmbedding, apply_rotary, apply_rotary_qk_
from flashvlm.models.interfaces import KVCacheSpec

# checkpoint projection name -> (packed module name, shard index)
PACKED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = _head_dim(cfg)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, [q_size, kv_size, kv_size], bias=qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False) and qkv_bias)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx)
        # Qwen3: an RMSNorm over each query and key head, before the rotary.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.use_triton_kernels = True
        """Fused rotary kernel on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        norm = None if self.q_norm is None else QKNorm(self.q_norm.weight, self.k_norm.weight, self.num_heads,
                                                       self.q_norm.eps)
        # One launch normalizes (Qwen3) and rotates queries and keys in place (within an ulp of the torch path);
        # q and k stay strided views of the packed output, which the attention kernels read directly.
        fused = apply_rotary_qk_(qkv, cos, sin, self.num_heads + self.num_kv_heads, self.head_dim,
                                 enabled=self.use_triton_kernels, qk_norm=norm)
        if not fused and self.q_norm is not None:
            q, k, v = self.qkv_proj.split_output(qkv)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(n, -1)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(n, -1)
            qkv = torch.cat((q, k, v), dim=-1)
        q, k, v = self.qkv_proj.split_output(qkv)
        if not fused:
            q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin).reshape(n, -1)
            k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin).reshape(n, -1)
        return self.o_proj(self.attn(q, k, v, ctx))


class PreNormLayer(nn.Module):
    """A pre-norm decoder layer's step, whatever its parts: norm, attention, norm with the residual added, MLP.
    Subclasses build `input_layernorm`, `self_attn`, `post_attention_layernorm` and `mlp`; the norms take an
    optional residual and return (normed, new residual)."""

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def run_decoder_layers(layers: nn.ModuleList, rotary: nn.Module, final_norm: nn.Module, inputs_embeds: torch.Tensor,
                       positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """The pre-norm stack's pass: rotary tables once, each layer carrying the residual, the final norm adding it."""
    cos, sin = rotary(positions, inputs_embeds.dtype)
    h, residual = inputs_embeds, None
    for layer in layers:
        h, residual = layer(h, residual, cos, sin, ctx)
    h, _ = final_norm(h, residual)
    return h


class DecoderLayer(PreNormLayer):
    def __init__(self, cfg, layer_idx: int, qkv_bias: bool, qk_norm: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DecoderAttention(cfg, layer_idx, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act,
                            bias=getattr(cfg, "mlp_bias", False))


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm; `forward` takes embeddings so images can be spliced in."""

    def __init__(self, cfg, qkv_bias: bool, mrope: bool, qk_norm: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, qkv_bias, qk_norm) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        self.rotary = MRotaryEmbedding(_head_dim(cfg), rope) if mrope else RotaryEmbedding(_head_dim(cfg), rope)

    def kv_cache_spec(self) -> KVCacheSpec:
        # This rank's KV heads: the tensor-parallel pass leaves each layer its share.
        return KVCacheSpec(self.cfg.num_hidden_layers, self.layers[0].self_attn.num_kv_heads, _head_dim(self.cfg))

    def forward(self, inputs_embeds: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return run_decoder_layers(self.layers, self.rotary, self.norm, inputs_embeds, positions, ctx)
