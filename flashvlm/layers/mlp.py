"""Gated MLP (SwiGLU and friends) with gate and up projections packed into one GEMM, and the vision towers' plain
two-layer MLP."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.layers.activation import SiluAndMul, get_activation
from flashvlm.layers.linear import Linear, MergedLinear, PlainLinear, gemv_locks

ALIGNED_WIDTH = 8
"""Rows of a multiple of 8 bf16 elements start on 16-byte boundaries; cuBLAS's fast Hopper GEMMs need that. With
K = 3,420 (Qwen2.5-VL's vision MLP) the down projection of 9,216 rows ran at 209 TFLOP/s on an H200, at K =
3,456 at 740."""
PADDED_MULTIPLE = 64


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False,
                 pad_unaligned: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [intermediate, intermediate], bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act_and_mul = SiluAndMul() if act == "silu" else None
        self.act = get_activation(act)
        self.pad_unaligned = pad_unaligned
        """Pad an unaligned intermediate width once the weights are in (`pad_intermediate`). Set for vision
        towers only: a decoder's MLP may still be split across ranks or loaded pre-quantized after that."""

    @torch.no_grad()
    def pad_intermediate(self) -> bool:
        """Widen an intermediate width that is not a multiple of ALIGNED_WIDTH to one of PADDED_MULTIPLE, with
        zero gate and up rows (their bias too) and zero down columns: a padded channel's activation is act(0) * 0
        = 0 and meets a zero weight, so the output is the unpadded one. Only plain layers are padded (a quantized
        layer keeps its checkpoint's shapes). Returns whether it padded."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if not self.pad_unaligned or type(gate_up) is not MergedLinear or type(down) is not Linear:
            return False
        width = down.in_features
        if width % ALIGNED_WIDTH == 0:
            return False
        padded = -(-width // PADDED_MULTIPLE) * PADDED_MULTIPLE
        rows = torch.cat([torch.arange(width), padded + torch.arange(width)]).to(gate_up.weight.device)
        for name in ("weight", "bias"):
            old = getattr(gate_up, name)
            if old is not None:
                new = old.new_zeros((2 * padded, *old.shape[1:]))
                new.index_copy_(0, rows, old)
                setattr(gate_up, name, nn.Parameter(new, requires_grad=False))
        gate_up.out_features, gate_up.out_sizes = 2 * padded, [padded, padded]
        gate_up.gemv_locks = gemv_locks(2 * padded, gate_up.gemv_locks.device)
        new = down.weight.new_zeros(down.out_features, padded)
        new[:, :width] = down.weight
        down.weight, down.in_features = nn.Parameter(new, requires_grad=False), padded
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_and_mul is not None:
            return self.down_proj(self.act_and_mul(gate_up))
        gate, up = self.gate_up_proj.split_output(gate_up)
        return self.down_proj(self.act(gate) * up)


def pad_unaligned_mlps(model: nn.Module) -> int:
    """`GatedMLP.pad_intermediate` on every gated MLP of `model` that asks for it, once its weights are loaded and
    before any quantization pass reads them; returns how many were padded."""
    return sum(m.pad_intermediate() for m in model.modules() if isinstance(m, GatedMLP))


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
