"""Quantize-at-load on a sharded model: the quantization pass runs after the tensor-parallel passes, on each rank's
slices. Column-parallel layers (QKV, gate/up) hold whole output rows and read the whole input, so their
per-output-channel weight scales and per-token activation scales are those of tensor_parallel_size 1. A
row-parallel layer (o_proj, down_proj) holds a slice of each row's weights and of each token's input; both are
rounded with the scales of the whole row: the largest |w| of each weight row and the largest |x| of each token, over
all ranks. Each rank's integer product is then exactly its share of the one-rank product; only the float sum of the
ranks' scaled partial products is in another order.

The methods' own per-row rules are reused by padding: the weight gets PAD more columns, the first holding each row's
whole-row amax (so the rule picks the whole row's scale) and zeroed once rounded; each token gets PAD more inputs,
the first its whole-row amax. The zero weight columns make the extra inputs add nothing. PAD keeps K a multiple of
16, which the GPU's int8 and fp8 GEMMs take.

int4 (W4A16) scales groups of inputs of each row and leaves activations in the model dtype: a row-parallel slice of
whole groups rounds exactly as those groups of the whole row, so it needs no padding; a slice that is not a multiple
of the group size is refused."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flashvlm.config import ConfigError
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.layers import PlainRowParallelLinear, RowParallelLinear
from flashvlm.layers.linear import PlainLinear
from flashvlm.quant.apply import float_targets, replace_module
from flashvlm.quant.base import QuantizedLinear, QuantMethod, frozen
from flashvlm.quant.plan import QuantPlan
from flashvlm.quant.registry import get_method

PADDED_METHODS = ("int8", "fp8")
"""A weight scale per output channel, the weight laid out (N, K), a scale per token for the activations."""
GROUPED_METHODS = ("int4",)
"""Weight scales per group of inputs (`scheme.group_size`), activations unrounded."""
SHARDED_METHODS = PADDED_METHODS + GROUPED_METHODS
"""Methods whose quantize-at-load runs with tensor parallelism."""
PAD = 16


class QuantizedRowParallel(nn.Module):
    """A row-parallel layer whose slice of the weight is quantized: the partial products summed over ranks, then
    the bias once."""

    def __init__(self, inner: QuantizedLinear, group: TPGroup, bias: torch.Tensor | None, pad: int) -> None:
        super().__init__()
        self.inner, self.group, self.pad = inner, group, pad
        """pad: 0, or PAD (each token gets its whole-row amax as the first of PAD more inputs)."""
        self.in_features, self.out_features = inner.in_features - pad, inner.out_features
        self.bias = None if bias is None else frozen(bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad:
            amax = self.group.all_max(x.abs().amax(dim=-1, keepdim=True))
            x = torch.cat([x, amax, x.new_zeros(*x.shape[:-1], self.pad - 1)], dim=-1)
        out = self.group.all_reduce(self.inner(x))
        return out if self.bias is None else out + self.bias


@torch.no_grad()
def _quantize_row_slice(layer: nn.Module, method: QuantMethod, scheme: Any, group: TPGroup) -> QuantizedRowParallel:
    weight = layer.weight.detach()
    n, k = weight.shape
    row_amax = group.all_max(weight.abs().amax(dim=1, keepdim=True))
    padded = PlainLinear(k + PAD, n, bias=False).to(device=weight.device, dtype=weight.dtype)
    padded.weight.copy_(torch.cat([weight, row_amax, weight.new_zeros(n, PAD - 1)], dim=1))
    inner = method.quantize(padded, scheme)
    if not isinstance(inner, QuantizedLinear) or tuple(inner.weight.shape) != (n, k + PAD):
        raise ConfigError(f"{method.name} layers cannot be split by input columns under tensor parallelism")
    inner.weight.data[:, k:] = 0
    return _wrap(inner, layer, group, PAD)


@torch.no_grad()
def _quantize_whole_groups(layer: nn.Module, method: QuantMethod, scheme: Any, group: TPGroup,
                           name: str) -> QuantizedRowParallel:
    weight = layer.weight.detach()
    n, k = weight.shape
    size = getattr(scheme, "group_size", None)
    if size is None or k % size:
        raise ConfigError(f"--quantization {method.name} with tensor_parallel_size {group.size}: {name} holds {k} "
                          f"inputs per rank, not a whole number of its groups of {size or 'a whole row'}")
    local = PlainLinear(k, n, bias=False).to(device=weight.device, dtype=weight.dtype)
    local.weight.copy_(weight)
    return _wrap(method.quantize(local, scheme), layer, group, 0)


def _wrap(inner: QuantizedLinear, layer: nn.Module, group: TPGroup, pad: int) -> QuantizedRowParallel:
    inner.use_triton_kernels = getattr(layer, "use_triton_kernels", True)
    inner.gemv_max_rows = getattr(layer, "gemv_max_rows", inner.gemv_max_rows)
    return QuantizedRowParallel(inner, group, layer.bias, pad)


def quantize_sharded(model: nn.Module, plan: QuantPlan, group: TPGroup) -> None:
    """quant/apply.quantize_model for a model the tensor-parallel passes have split (its float weights loaded);
    the method is one of SHARDED_METHODS (config.py refuses the others)."""
    method = get_method(plan.method)
    for name in float_targets(model, plan.quantize_vision):
        layer = model.get_submodule(name)
        if isinstance(layer, (RowParallelLinear, PlainRowParallelLinear)) and plan.method in GROUPED_METHODS:
            replace_module(model, name, _quantize_whole_groups(layer, method, plan.scheme, group, name))
        elif isinstance(layer, (RowParallelLinear, PlainRowParallelLinear)):
            replace_module(model, name, _quantize_row_slice(layer, method, plan.scheme, group))
        else:
            replace_module(model, name, method.quantize(layer, plan.scheme))
