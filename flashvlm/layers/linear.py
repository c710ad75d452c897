"""Linear layers. Packed projections (QKV, gate/up) are one GEMM at run time and load from separate
checkpoint tensors by shard."""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One Linear whose output rows are the concatenation of several checkpoint projections."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        start = sum(self.out_sizes[:shard])
        param = getattr(self, param_name)
        target = param.data[start : start + self.out_sizes[shard]]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {shard} of {param_name}: expected {tuple(target.shape)}, "
                             f"got {tuple(tensor.shape)}")
        target.copy_(tensor)

    def split_output(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.out_sizes, dim=-1)
