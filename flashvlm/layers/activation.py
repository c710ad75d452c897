"""Activations by Hugging Face config name, and the gated SiLU used by SwiGLU MLPs."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashvlm.kernels.dispatch import use_triton


def quick_gelu_reference(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x) as transformers computes it; the fused kernel's reference."""
    return x * torch.sigmoid(1.702 * x)


def quick_gelu(x: torch.Tensor, *, enabled: bool | None = None, force: bool = False) -> torch.Tensor:
    if use_triton(x, enabled, force):
        from flashvlm.kernels.activation import quick_gelu_triton  # lazy: Triton loads on the first kernel call

        return quick_gelu_triton(x)
    return quick_gelu_reference(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2 (Persimmon's MLP, transformers' "relu2")."""
    return torch.square(F.relu(x))


_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "quick_gelu": quick_gelu_reference,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu_new": gelu_new,
    "relu": F.relu,
    "relu2": relu_squared,
}


class Activation(nn.Module):
    """A named activation (no weights). quick_gelu, the vision MLPs' activation, runs as one fused kernel on
    CUDA tensors: it reads and writes the MLP's widest activation once instead of three times."""

    def __init__(self, name: str) -> None:
        super().__init__()
        if name not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {name!r}; known: {sorted(_ACTIVATIONS)}")
        self.name = name
        self.use_triton_kernels = True
        """Fused Triton kernel on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.name == "quick_gelu":
            return quick_gelu(x, enabled=self.use_triton_kernels)
        return _ACTIVATIONS[self.name](x)

    def extra_repr(self) -> str:
        return self.name


def get_activation(name: str) -> Activation:
    return Activation(name)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]: the torch math and the fused kernel's reference."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul(x: torch.Tensor, *, enabled: bool | None = None, force: bool = False) -> torch.Tensor:
    if use_triton(x, enabled, force) and x.shape[-1] % 2 == 0:
        from flashvlm.kernels.activation import silu_and_mul_triton  # lazy: Triton loads on the first kernel call

        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for a packed gate/up projection."""

    def __init__(self) -> None:
        super().__init__()
        self.use_triton_kernels = True
        """Fused Triton kernel on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, enabled=self.use_triton_kernels)
