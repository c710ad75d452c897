"""Normalization layers, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashvlm.kernels.dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """The torch math (the CPU path, and the reference the fused kernel is tested against). The normalized
    value is cast to the input dtype before the weight multiply, as transformers does."""
    if residual is not None:
        x = x + residual
        residual = x
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, *,
                      enabled: bool | None = None, force: bool = False):
    """RMSNorm(x [+ residual]): returns `out`, or `(out, x + residual)` when a residual is given."""
    if use_triton(x, enabled, force) and (residual is None or residual.dtype == x.dtype):
        from flashvlm.kernels.norm import rmsnorm_triton  # lazy: Triton loads on the first kernel call

        return rmsnorm_triton(x, residual, weight, eps)
    return rms_norm_reference(x, residual, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.use_triton_kernels = True
        """Fused Triton kernel on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, adds it first and returns (normed, new_residual): the fused-kernel contract."""
        return fused_add_rmsnorm(x, residual, self.weight, self.eps, enabled=self.use_triton_kernels)


def layer_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float):
    """torch's LayerNorm after the residual add (in the input dtype); the fused kernel's reference."""
    if residual is not None:
        x = x + residual
        residual = x
    out = F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    return out if residual is None else (out, residual)


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters and math, plus the fused residual add of RMSNorm's contract: with `residual`,
    returns (normed, x + residual), one pass over the rows on CUDA."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.use_triton_kernels = True
        """Fused Triton kernel on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (use_triton(x, self.use_triton_kernels) and self.weight.dtype == x.dtype
                and (residual is None or residual.dtype == x.dtype)):
            from flashvlm.kernels.norm import layernorm_triton  # lazy: Triton loads on the first kernel call

            return layernorm_triton(x, residual, self.weight, self.bias, self.eps)
        return layer_norm_reference(x, residual, self.weight, self.bias, self.eps)


class HeadLayerNorm(LayerNorm):
    """LayerNorm over each head of a (tokens, heads * head_dim) projection: the QK-norm of Persimmon's attention,
    one LayerNorm of width head_dim shared by every head (the fused kernel on CUDA, as LayerNorm)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            raise ValueError("HeadLayerNorm takes no residual")
        n = x.shape[0]
        return super().forward(x.reshape(-1, self.weight.shape[0])).view(n, -1)
