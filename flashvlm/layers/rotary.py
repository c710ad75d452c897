"""Rotary position embeddings: 1-D RoPE (Llama) and multimodal M-RoPE (Qwen2-VL sectioned, Qwen3-VL interleaved),
half-rotation layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashvlm.kernels.dispatch import use_triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos/sin: (tokens, head_dim). The torch math and the kernels' reference."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype,
                   mrope_section: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (tokens,), or (3, tokens) with `mrope_section` -> cos, sin (tokens, head_dim) in `dtype`.

    M-RoPE: frequency band i takes its angle from axis i % 3 over the `mrope_section` split of the half
    dimension; 1-D positions use the same position on every axis."""
    if mrope_section is None:
        freqs = positions.float()[:, None] * inv_freq[None, :]
    else:
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        freqs = positions.float()[:, :, None] * inv_freq[None, None, :]  # (3, tokens, half)
        chunks = freqs.split(mrope_section, dim=-1)
        freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos/sin: (tokens, head_dim). Out of place, plain torch."""
    return apply_rotary_reference(x, cos, sin)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (tokens, heads, head_dim); cos/sin: (tokens, rotary_dim) with rotary_dim <= head_dim. Rotates the first
    rotary_dim channels of each head (half-rotation layout within them) and passes the rest through (Persimmon's
    partial rotary). Out of place, plain torch: the fused kernel rotates whole heads only."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary_reference(x, cos, sin)
    return torch.cat((apply_rotary_reference(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


def apply_partial_rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int,
                          *, enabled: bool | None = None, force: bool = False) -> torch.Tensor:
    """`apply_partial_rotary` of x (tokens, num_heads * head_dim, a contiguous last dim), heads side by side: in
    place with the fused kernel where it runs (one launch instead of the torch path's slices, products and
    concatenation), else out of place in torch. Returns the rotated tensor either way."""
    if use_triton(x, enabled, force) and x.dim() == 2 and x.stride(1) == 1:
        from flashvlm.kernels.rotary import rotary_qk_inplace  # lazy: Triton loads on the first kernel call

        rotary_qk_inplace(x, cos, sin, num_heads, head_dim, rotary_dim=cos.shape[-1])
        return x
    n = x.shape[0]
    return apply_partial_rotary(x.reshape(n, num_heads, head_dim), cos, sin).reshape(n, -1)


def apply_head_norm_rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int,
                            q_norm: nn.Module, k_norm: nn.Module, *, enabled: bool | None = None,
                            force: bool = False) -> bool:
    """Persimmon's per-head LayerNorm of the queries and keys (`q_norm`, `k_norm`: LayerNorms of width head_dim)
    and its partial rotary, in place on the packed projection `qkv` (num_heads query heads, then as many key
    heads) in one launch. Returns False, touching nothing, where the kernel does not run."""
    params = (q_norm.weight, q_norm.bias, k_norm.weight, k_norm.bias)
    if (not use_triton(qkv, enabled, force) or qkv.dim() != 2 or qkv.stride(1) != 1 or q_norm.eps != k_norm.eps
            or any(p.dtype != qkv.dtype or p.shape != (head_dim,) for p in params)):
        return False
    from flashvlm.kernels.head_norm_rotary import head_norm_rotary_inplace  # lazy: Triton loads on first use

    head_norm_rotary_inplace(qkv, cos, sin, num_heads, num_heads, head_dim, (q_norm.weight, q_norm.bias),
                             (k_norm.weight, k_norm.bias), q_norm.eps)
    return True


@dataclass(frozen=True)
class QKNorm:
    """Qwen3's RMSNorm over each query and key head, for the fused rotary kernel to apply first."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    num_q_heads: int
    eps: float

    def fits(self, qkv: torch.Tensor, head_dim: int) -> bool:
        return all(w.shape == (head_dim,) and w.dtype == qkv.dtype and w.device == qkv.device and w.is_contiguous()
                   for w in (self.q_weight, self.k_weight))


def apply_rotary_qk_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int, *,
                     enabled: bool | None = None, force: bool = False, fp32_math: bool = False,
                     qk_norm: QKNorm | None = None) -> bool:
    """Rotate the first `num_heads` heads of each row of the packed projection `qkv` in place (queries then
    keys) with the fused Triton kernel, RMS-normalizing each head first with `qk_norm`. Returns False, touching
    nothing, where the kernel does not run. fp32_math: round once at the end, as the vision towers' float32
    rotary does."""
    if not use_triton(qkv, enabled, force) or qkv.dim() != 2 or qkv.stride(1) != 1:
        return False
    if qk_norm is not None and (cos.shape[-1] != head_dim or not qk_norm.fits(qkv, head_dim)):
        return False
    from flashvlm.kernels.rotary import rotary_qk_inplace  # lazy: Triton loads on the first kernel call

    rotary_qk_inplace(qkv, cos, sin, num_heads, head_dim, fp32_math=fp32_math, qk_norm=qk_norm)
    return True


def _inv_freq(head_dim: int, rope_parameters: dict) -> tuple[torch.Tensor, float]:
    rope_type = rope_parameters.get("rope_type", rope_parameters.get("type", "default"))
    theta = float(rope_parameters.get("rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type in ("default", "mrope"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(rope_parameters["factor"]), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear)")


class RotaryEmbedding(nn.Module):
    """positions (tokens,) -> cos, sin (tokens, head_dim) in the query dtype."""

    mrope_section: list[int] | None = None  # set by MRotaryEmbedding

    def __init__(self, head_dim: int, rope_parameters: dict) -> None:
        super().__init__()
        inv_freq, self.scaling = _inv_freq(head_dim, rope_parameters)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions, self.inv_freq, self.scaling, dtype, self.mrope_section)


class MRotaryEmbedding(RotaryEmbedding):
    """positions (3, tokens) for (temporal, height, width); frequency band i takes its angle from axis
    i % 3 over the `mrope_section` split of the half dimension."""

    def __init__(self, head_dim: int, rope_parameters: dict) -> None:
        super().__init__(head_dim, rope_parameters)
        self.mrope_section = list(rope_parameters["mrope_section"])
        if sum(self.mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to head_dim/2 = {head_dim // 2}")
        self.interleaved = bool(rope_parameters.get("mrope_interleaved", False))
        """Qwen3-VL's layout: band j takes height where j % 3 == 1, width where j % 3 == 2, each within its
        section's share (3 * section), and time otherwise, so every axis spans low and high frequencies."""
        if self.interleaved:
            half = head_dim // 2
            axis = torch.zeros(half, dtype=torch.long)
            for dim in (1, 2):
                axis[dim:3 * self.mrope_section[dim]:3] = dim
            self.register_buffer("band_axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.interleaved:
            return super().forward(positions, dtype)
        if positions.dim() == 1:
            positions = positions.unsqueeze(0).expand(3, -1)
        freqs = positions.float()[:, :, None] * self.inv_freq[None, None, :]  # (3, tokens, half)
        freqs = freqs.gather(0, self.band_axis.view(1, 1, -1).expand(1, freqs.shape[1], -1))[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)
