"""Pre-quantized checkpoints under tensor parallelism: each rank reads only its slices of the stored quantized
tensors and their scales (sharded_load.narrow_checkpoint calls `narrow_quantized`), and its row-parallel layers
sum their partial products over ranks (`quantized_row_parallel`).

Column-parallel projections (QKV, gate/up) take their output rows: the weight's rows and their per-channel scales,
the block scales of those rows (FP8 blocks), the packed zero points of those rows (W4A16). Row-parallel projections
(o_proj, down_proj) take input columns: the weight's columns, all of its per-channel scales, the columns of its
groups or blocks, which must then fall on whole groups or blocks (refused otherwise). Per-tensor scales (static
activations, FP8 tensor weight scales) are the same on every rank.

The checkpoint's per-channel weight scales are those of the whole row already, so each rank's slice dequantizes
as the same slice of the one-rank weight. Activations rounded per token (dynamic FP8 and INT8) must use the whole
row's amax too: the row-parallel layer gets PAD zero weight columns and each token its amax over all ranks as the
first of PAD more inputs (quant_shard.QuantizedRowParallel, as quantize-at-load does). Block FP8 rounds
activations per token and block of columns: a rank holding whole blocks rounds them as one rank does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashvlm.config import ConfigError
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.quant_shard import PAD, QuantizedRowParallel
from flashvlm.quant.apply import VISION_ROOTS
from flashvlm.quant.base import QuantizedLinear, frozen
from flashvlm.quant.fp8_linear import Fp8Linear
from flashvlm.quant.int4_format import pack_rows, unpack_rows
from flashvlm.quant.int8 import Int8Linear
from flashvlm.quant.plan import QuantPlan

PER_TENSOR = ("input_scale", "input_zero_point")
"""Checkpoint tensors that hold one value for the whole layer: every rank takes them whole."""


@dataclass(frozen=True)
class Cut:
    """This rank's share of one checkpoint projection."""

    layer: str
    """The checkpoint's module name, for messages."""
    row_parallel: bool
    """True: input columns [start, start + length) of `full` (o_proj, down_proj); False: output rows."""
    start: int
    length: int
    full: int
    ranks: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _whole_units(cut: Cut, unit: int) -> bool:
    """Whether the share starts on a unit boundary and ends on one (or at the end of the dimension)."""
    return cut.start % unit == 0 and (cut.length % unit == 0 or cut.start + cut.length == cut.full)


def _refuse(cut: Cut, unit: int, what: str) -> ConfigError:
    side = "inputs" if cut.row_parallel else "output rows"
    return ConfigError(f"pre-quantized checkpoint with tensor_parallel_size {cut.ranks}: {cut.layer} holds "
                       f"{cut.length} of its {cut.full} {side} per rank, not a whole number of its {what} of {unit}")


def _narrow(tensor: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return tensor.narrow(dim, start, length).contiguous()


def narrow_quantized(suffix: str, tensor: torch.Tensor, cut: Cut, plan: QuantPlan) -> torch.Tensor:
    """This rank's part of a quantized layer's checkpoint tensor `<layer>.<suffix>` (not `weight` or `bias`,
    which are cut like float ones)."""
    if suffix in PER_TENSOR:
        return tensor
    if plan.method == "int4":
        return _narrow_int4(suffix, tensor, cut, plan.scheme.group_size)
    block = getattr(plan.scheme, "block", None)
    if block is not None and suffix == plan.scheme.block_scale_name:
        return _narrow_blocks(tensor, cut, block)
    if suffix in ("weight_scale", "weight_zero_point"):
        # One per output channel ((N, 1) or (N,)), or one for the whole projection.
        if cut.row_parallel or tensor.numel() == 1:
            return tensor
        return _narrow(tensor, 0, cut.start, cut.length)
    raise ConfigError(f"{cut.layer}.{suffix}: a {plan.method} checkpoint tensor that tensor parallelism does not "
                      "know how to split")


def _narrow_blocks(scale: torch.Tensor, cut: Cut, block: tuple[int, int]) -> torch.Tensor:
    """FP8 block scales (ceil(N / rows), ceil(K / cols)). Row-parallel: whole column blocks only (each block
    column is also a dynamic activation group). Column-parallel: the block rows from a block boundary, or the one
    block row a share lies in (its rows all take that block's scales)."""
    rows, cols = block
    if cut.row_parallel:
        if not _whole_units(cut, cols):
            raise _refuse(cut, cols, "weight blocks' columns")
        return _narrow(scale, 1, cut.start // cols, _cdiv(cut.length, cols))
    if cut.start % rows == 0:
        return _narrow(scale, 0, cut.start // rows, _cdiv(cut.length, rows))
    if cut.start // rows == (cut.start + cut.length - 1) // rows:
        return _narrow(scale, 0, cut.start // rows, 1)
    raise _refuse(cut, rows, "weight blocks' rows")


def _narrow_int4(suffix: str, tensor: torch.Tensor, cut: Cut, group_size: int | None) -> torch.Tensor:
    """pack-quantized W4A16: `weight_packed` (N, ceil(K / 8)) int32, 8 inputs a word; `weight_scale` (N, G);
    `weight_zero_point` (ceil(N / 8), G), packed along the output rows; `weight_shape` [N, K]. A channel scale
    (group_size None) covers the whole row: every rank takes it whole."""
    if suffix == "weight_shape":
        n, k = (int(v) for v in tensor)
        return torch.tensor([n, cut.length] if cut.row_parallel else [cut.length, k], dtype=tensor.dtype)
    if cut.row_parallel:
        if group_size is not None and not _whole_units(cut, group_size):
            raise _refuse(cut, group_size, "groups")
        if suffix == "weight_packed":
            if cut.start % 8 == 0:
                return _narrow(tensor, 1, cut.start // 8, _cdiv(cut.length, 8))
            return pack_rows(unpack_rows(tensor, cut.full)[:, cut.start:cut.start + cut.length])
        if suffix in ("weight_scale", "weight_zero_point"):
            if group_size is None:
                return tensor
            return _narrow(tensor, 1, cut.start // group_size, _cdiv(cut.length, group_size))
    elif suffix in ("weight_packed", "weight_scale"):
        return _narrow(tensor, 0, cut.start, cut.length)
    elif suffix == "weight_zero_point":
        codes = unpack_rows(tensor.t().contiguous(), cut.full)  # (G, N)
        return pack_rows(codes[:, cut.start:cut.start + cut.length].contiguous()).t().contiguous()
    raise ConfigError(f"{cut.layer}.{suffix}: an int4 checkpoint tensor that tensor parallelism does not know "
                      "how to split")


def _rounds_per_token(layer: QuantizedLinear) -> bool:
    """Whether the layer rounds each token's activations with that token's amax over its inputs."""
    if isinstance(layer, Fp8Linear):
        return layer.scheme.activation == "dynamic" and layer.scheme.block is None
    if isinstance(layer, Int8Linear):
        return layer.x_scale is None
    return False


@torch.no_grad()
def quantized_row_parallel(layer: QuantizedLinear, group: TPGroup, start: int, end: int,
                           name: str) -> QuantizedRowParallel:
    """A loaded quantized layer holding this rank's input columns, as a row-parallel layer: its bias added once
    after the sum, and (activations rounded per token) PAD zero weight columns for the whole row's amax."""
    if (start, end) != (0, layer.in_features):
        raise ConfigError(f"{name} is stored quantized and loaded whole: pre-quantized layers are split as they "
                          "load, which this decoder does not do")
    pad = PAD if _rounds_per_token(layer) else 0
    if pad:
        weight = layer.weight.data
        layer.weight = frozen(torch.cat([weight, weight.new_zeros(weight.shape[0], pad)], dim=1))
        layer.in_features += pad
    bias = layer.bias
    layer.bias = None
    return QuantizedRowParallel(layer, group, bias, pad)


def check_vision_float(model: nn.Module) -> None:
    """--mm-encoder-tp-mode weights splits the vision tower's float layers; a tower stored quantized runs whole."""
    for root in VISION_ROOTS:
        tower = getattr(model, root, None)
        if tower is None:
            continue
        for name, module in tower.named_modules():
            if isinstance(module, QuantizedLinear):
                raise ConfigError(f"{root}.{name} is stored quantized: mm_encoder_tp_mode 'weights' splits float "
                                  "vision layers; use mm_encoder_tp_mode 'data' (the tower whole on each rank)")
