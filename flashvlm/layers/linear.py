"""Linear layers. Packed projections (QKV, gate/up) are one GEMM at run time and load from separate
checkpoint tensors by shard. A product of a few rows (decode at small batch) runs our Triton GEMV on CUDA where it
streams the weights faster than cuBLAS (kernels/gemv.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashvlm.kernels.dispatch import use_triton

GEMV_MAX_ROWS = 16
"""Most rows a product may have to take the GEMV: its tensor-core tile pads the rows to 16."""
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def gemv_applies(x: torch.Tensor, weight: torch.Tensor, max_rows: int, enabled: bool | None = None,
                 force: bool = False) -> bool:
    """Whether `x @ weight.T` should run the GEMV: 2-D, 1..max_rows rows, half precision, rows of W contiguous."""
    if x.dim() != 2 or not 0 < x.shape[0] <= max_rows or weight.stride(1) != 1:
        return False
    if not force and (x.dtype not in _GEMV_DTYPES or weight.dtype != x.dtype):
        return False
    return use_triton(x, enabled, force)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           max_rows: int = GEMV_MAX_ROWS, enabled: bool | None = None, force: bool = False,
           locks: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); few rows take the Triton GEMV (`locks`: its split-K counters, see gemv_triton)."""
    if gemv_applies(x, weight, max_rows, enabled, force):
        from flashvlm.kernels.gemv import gemv_triton  # lazy: Triton loads on the first kernel call

        return gemv_triton(x, weight, bias, locks=locks)
    return F.linear(x, weight, bias)


class PlainLinear(nn.Linear):
    """A linear layer whose forward is exactly F.linear at every row count (no GEMV): vision towers and
    projectors, whose products of a few rows (a tiny image's merger) stay on the library GEMM. A layer of its own
    so a later pass (quantization, sharding) finds every linear layer of a model among `layers/` classes."""


def gemv_locks(out_features: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The GEMV's split-K arrival counters for a layer of `out_features` outputs: one per 16 output columns (the
    narrowest column block), zeros."""
    return torch.zeros(-(-out_features // 16), dtype=torch.int32, device=device)


class Linear(nn.Linear):
    """nn.Linear whose few-row products take the Triton GEMV on CUDA tensors."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.use_triton_kernels = True
        """Triton GEMV on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""
        self.gemv_max_rows = GEMV_MAX_ROWS
        """Products of at most this many rows take the GEMV; the engine sets 0 (never) for decode_gemv=False."""
        # The GEMV's split-K arrival counters, zeros between calls; each layer owns its own, so no two products in
        # flight share them.
        self.register_buffer("gemv_locks", gemv_locks(out_features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, max_rows=self.gemv_max_rows, enabled=self.use_triton_kernels,
                      locks=self.gemv_locks)


class MergedLinear(Linear):
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


def set_gemv_max_rows(model: nn.Module, rows: int) -> None:
    """Products of at most `rows` rows take the GEMV in every Linear of `model` (0: none). Also zeroes the GEMV's
    split-K counters, which must start at zero however the model was built (e.g. `to_empty` from meta)."""
    for module in model.modules():
        if hasattr(module, "gemv_max_rows"):
            module.gemv_max_rows = rows
        locks = getattr(module, "gemv_locks", None)  # a Linear's, or a quantized layer's low-row kernel's
        if isinstance(locks, torch.Tensor):
            locks.zero_()
