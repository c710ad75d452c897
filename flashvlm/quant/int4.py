"""INT4 W4A16: 4-bit integer weights with a float scale (and, asymmetric, a zero point) per group of inputs and
output channel; activations stay in the model dtype. Products of at most `gemv_max_rows` rows run the W4A16
GEMV on CUDA, larger ones the W4A16 GEMM (kernels/int4_matmul.py); CPU tensors and kernel_backend torch
dequantize the weight and call torch's linear (the reference of the kernels).

Checkpoints: compressed-tensors `pack-quantized` with 4-bit int weights, group strategy (any group size that is a
multiple of 32: 32, 64 and 128 are llm-compressor's) or channel strategy, symmetric or asymmetric
(quant/int4_format.py). `--quantization int4` rounds float weights to nearest, groups of 128, symmetric, with
the same conventions, so both run the same kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flashvlm.kernels.dispatch import use_triton
from flashvlm.kernels.int4_layout import pack_planes, w4a16_reference
from flashvlm.quant.base import QuantFormatError, QuantizedLinear, QuantMethod, frozen, out_sizes_of
from flashvlm.quant.int4_format import pack_rows, rtn_codes, to_runtime, unpack_rows

_KERNEL_DTYPES = (torch.bfloat16, torch.float16)
_OTHER_INT4_METHODS = {"awq": "AWQ", "awq_marlin": "AWQ", "gptq": "GPTQ", "gptq_marlin": "GPTQ",
                       "marlin": "Marlin", "bitsandbytes": "bitsandbytes"}
_STATIC_ACTORDER = (None, False, "weight", "static")
"""GPTQ activation orders that leave groups contiguous (no g_idx tensor); "group"/"dynamic" store a g_idx."""


@dataclass(frozen=True)
class Int4Scheme:
    bits: int = 4
    group_size: int | None = 128
    """Inputs per scale; None: one scale per output channel (compressed-tensors' channel strategy)."""
    symmetric: bool = True


class Int4Linear(QuantizedLinear):
    """A linear layer with W4A16 weights in the kernels' plane layout (`qweight`, `scales` (G, N), `zeros`).

    Built empty for a checkpoint it holds the checkpoint's tensors under their own names (`weight_packed`,
    `weight_scale`, `weight_zero_point`, `weight_shape`) until `finish_loading` converts them."""

    method = "int4"

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str, scheme: Int4Scheme) -> None:
        super().__init__(in_features, out_sizes, bias, dtype, device)
        self.scheme = scheme
        self.group_size = scheme.group_size or self.in_features
        self.num_groups = -(-self.in_features // self.group_size)
        self.register_parameter("qweight", None)
        self.register_parameter("scales", None)
        self.register_parameter("zeros", None)

    # ---- building -------------------------------------------------------------------------------
    def allocate_checkpoint_tensors(self) -> None:
        n, k, groups, device = self.out_features, self.in_features, self.num_groups, self.gemv_locks.device
        self.weight_packed = frozen(torch.zeros(n, -(-k // 8), dtype=torch.int32, device=device))
        self.weight_scale = frozen(torch.zeros(n, groups, dtype=self.dtype, device=device))
        if not self.scheme.symmetric:
            self.weight_zero_point = frozen(torch.zeros(-(-n // 8), groups, dtype=torch.int32, device=device))
        self.weight_shape = frozen(torch.zeros(2, dtype=torch.int64, device=device))

    def set_runtime(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None) -> None:
        self.qweight = frozen(qweight)
        self.scales = frozen(scales.to(self.dtype).contiguous())
        self.zeros = None if zeros is None else frozen(zeros.contiguous())

    # ---- loading --------------------------------------------------------------------------------
    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        rows = self.out_sizes[shard]
        if param_name == "weight_shape":
            if [int(v) for v in tensor] != [rows, self.in_features]:
                raise QuantFormatError(f"shard {shard}: weight_shape {tensor.tolist()} != "
                                       f"[{rows}, {self.in_features}]")
            self.weight_shape.copy_(torch.tensor([self.out_features, self.in_features]))
        elif param_name == "weight_zero_point":  # packed along the output rows: shards need not fill whole words
            start = sum(self.out_sizes[:shard])
            if tensor.shape != (-(-rows // 8), self.num_groups):
                raise ValueError(f"shard {shard} of weight_zero_point: expected {(-(-rows // 8), self.num_groups)},"
                                 f" got {tuple(tensor.shape)}")
            codes = unpack_rows(self.weight_zero_point.t().contiguous(), self.out_features)
            codes[:, start:start + rows] = unpack_rows(tensor.t().contiguous(), rows)
            self.weight_zero_point.copy_(pack_rows(codes).t())
        else:
            super().load_shard(param_name, shard, tensor)

    def finish_loading(self) -> None:
        shape = [int(v) for v in self.weight_shape]
        if shape != [self.out_features, self.in_features]:
            raise QuantFormatError(f"weight_shape {shape} does not match the layer's "
                                   f"[{self.out_features}, {self.in_features}]")
        zero_point = getattr(self, "weight_zero_point", None)
        self.set_runtime(*to_runtime(self.weight_packed, self.weight_scale, zero_point, self.in_features,
                                     self.dtype))
        for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            if hasattr(self, name):
                delattr(self, name)

    # ---- running --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x.reshape(-1, self.in_features))
        return out.view(*x.shape[:-1], self.out_features)

    def product(self, x: torch.Tensor, *, force: bool = False) -> torch.Tensor:
        """x (M, K) -> (M, N); `force` runs the kernels on CPU tensors (tests, under TRITON_INTERPRET=1)."""
        kernel_dtype = force or x.dtype in _KERNEL_DTYPES
        if not (kernel_dtype and use_triton(x, self.use_triton_kernels, force)):
            return w4a16_reference(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)
        from flashvlm.kernels.int4_matmul import w4a16_gemm, w4a16_gemv  # lazy: Triton loads on first use

        if 0 < x.shape[0] <= self.gemv_max_rows:
            return w4a16_gemv(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                              locks=self.gemv_locks)
        return w4a16_gemm(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)

    def describe(self) -> dict[str, Any]:
        groups = "channel" if self.scheme.group_size is None else f"group {self.scheme.group_size}"
        kind = "symmetric" if self.scheme.symmetric else "asymmetric"
        return {"method": self.method, "weights": f"int4 {groups} {kind}",
                "activations": str(self.dtype).removeprefix("torch.")}


def _float_layer_args(layer: nn.Module) -> tuple[int, list[int], bool, torch.dtype, torch.device]:
    return (int(layer.in_features), out_sizes_of(layer), layer.bias is not None, layer.weight.dtype,
            layer.weight.device)


class Int4Method(QuantMethod):
    name = "int4"

    def default_scheme(self) -> Int4Scheme:
        return Int4Scheme(group_size=128, symmetric=True)

    def scheme_from_checkpoint(self, quant_config: dict[str, Any]) -> Int4Scheme | None:
        method = str(quant_config.get("quant_method", "")).lower()
        if method in _OTHER_INT4_METHODS:
            raise QuantFormatError(
                f"{_OTHER_INT4_METHODS[method]} checkpoints (quant_method {method!r}) are not supported: flashvlm "
                "runs 4-bit weights in compressed-tensors' pack-quantized format (llm-compressor's W4A16 and "
                "W4A16_ASYM presets), or rounds a float checkpoint itself with --quantization int4")
        if method != "compressed-tensors":
            return None
        groups = dict(quant_config.get("config_groups") or {})
        formats = {name: g.get("format") or quant_config.get("format") for name, g in groups.items()}
        packed = [name for name, fmt in formats.items() if fmt == "pack-quantized"]
        if not packed:
            return None
        if len(packed) != len(groups):
            raise QuantFormatError(f"compressed-tensors checkpoint mixes formats across its config groups "
                                   f"({formats}); flashvlm runs one format per checkpoint")
        schemes = {_scheme_of_group(name, groups[name]) for name in packed}
        if len(schemes) > 1:
            raise QuantFormatError(f"pack-quantized config groups with different schemes ({sorted(map(str, schemes))})"
                                   " are not supported; flashvlm runs one W4A16 scheme per checkpoint")
        return schemes.pop()

    def is_quantized_tensor(self, checkpoint_name: str) -> bool:
        """`.weight_packed` marks a quantized layer. A `.weight_g_idx` (GPTQ activation reordering, which a
        config may not declare) is refused here, where every checkpoint name passes, rather than dropped."""
        if checkpoint_name.endswith(".weight_g_idx"):
            raise QuantFormatError(f"{checkpoint_name}: GPTQ activation reordering (a g_idx tensor) is not "
                                   "supported; flashvlm runs pack-quantized W4A16 with contiguous groups")
        return checkpoint_name.endswith(".weight_packed")

    def quantize(self, layer: nn.Module, scheme: Int4Scheme) -> Int4Linear:
        new = Int4Linear(*_float_layer_args(layer), scheme)
        with torch.no_grad():
            codes, scale, zero = rtn_codes(layer.weight, new.group_size, scheme.symmetric, new.dtype)
            new.set_runtime(pack_planes(codes), scale.t(), None if zero is None else zero.t())
            if layer.bias is not None:
                new.bias.copy_(layer.bias)
        return new

    def empty_layer(self, layer: nn.Module, scheme: Int4Scheme) -> Int4Linear:
        new = Int4Linear(*_float_layer_args(layer), scheme)
        new.allocate_checkpoint_tensors()
        return new


def _scheme_of_group(name: str, group: dict[str, Any]) -> Int4Scheme:
    """The scheme of one pack-quantized config group, or QuantFormatError naming what flashvlm cannot run."""
    w = group.get("weights") or {}

    def refuse(what: str) -> QuantFormatError:
        return QuantFormatError(f"compressed-tensors pack-quantized config group {name!r}: {what} is not supported; "
                                "flashvlm runs 4-bit integer weights (W4A16) with group or channel scales")

    if w.get("num_bits") != 4:
        bits = w.get("num_bits")
        raise refuse(f"{bits}-bit weights" + (" (W8A16)" if bits == 8 else ""))
    if w.get("type", "int") != "int":
        raise refuse(f"{w.get('type')!r} weights")
    if group.get("input_activations") or group.get("output_activations"):
        raise refuse("activation quantization (W4A8 and the like)")
    if w.get("dynamic"):
        raise refuse("dynamic weight quantization")
    if w.get("actorder") not in _STATIC_ACTORDER:
        raise refuse(f"activation reordering with a g_idx (actorder={w.get('actorder')!r})")
    size = w.get("group_size")
    strategy = w.get("strategy") or ("group" if size and size > 0 else "channel" if size == -1 else "tensor")
    if strategy == "channel":
        return Int4Scheme(group_size=None, symmetric=bool(w.get("symmetric", True)))
    if strategy != "group":
        raise refuse(f"the {strategy!r} strategy")
    if not isinstance(size, int) or size <= 0 or size % 32:
        raise refuse(f"group size {size!r} (flashvlm takes multiples of 32: 32, 64, 128, ...)")
    return Int4Scheme(group_size=size, symmetric=bool(w.get("symmetric", True)))
