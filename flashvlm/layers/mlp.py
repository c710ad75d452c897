"""Gated MLP (SwiGLU and friends) with gate and up projections packed into one GEMM, and the vision towers' plain
two-layer MLP."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.layers.activation import SiluAndMul, get_activation
from flashvlm.layers.linear import Linear, MergedLinear, PlainLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_and_mul = SiluAndMul() if act == "silu" else None
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(gate_up))
        gate, up = self.gate_up_proj.split_output(gate_up)
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    """dim -> hidden -> activation -> dim through two PlainLinears: the ungated MLP of the CLIP and Qwen-VL vision
    towers. `names` are the two projections' attribute names, which are the checkpoints' weight names: fc1 and fc2
    in CLIP and Qwen2-VL, linear_fc1 and linear_fc2 in Qwen3-VL."""

    def __init__(self, dim: int, hidden: int, act: str, names: tuple[str, str] = ("fc1", "fc2")) -> None:
        super().__init__()
        self.names = names
        self.add_module(names[0], PlainLinear(dim, hidden))
        self.act = get_activation(act)
        self.add_module(names[1], PlainLinear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.names
        return getattr(self, second)(self.act(getattr(self, first)(x)))
