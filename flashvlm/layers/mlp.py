"""Gated MLP (SwiGLU and friends) with gate and up projections packed into one GEMM."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.layers.activation import SiluAndMul, get_activation
from flashvlm.layers.linear import Linear, MergedLinear


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
