"""INT8 W8A8: int8 weights with a float scale per output channel, activations quantized to int8 per token at run
time (or with a per-tensor scale from the checkpoint), the products summed in int32 (kernels/int8_gemv.py).
Tensor cores run int8 on Ampere as well as Hopper, so GPUs without FP8 also read half the weight bytes.

Two sources: `--quantization int8` rounds a float checkpoint's weights (round to nearest, symmetric, amax / 127
per output channel; the scheme of llm-compressor's W8A8 preset, without its calibration), and compressed-tensors
checkpoints in their `int-quantized` format (what llm-compressor writes for W8A8): per layer `weight` (int8,
(N, K)) and `weight_scale` ((N, 1)), plus `input_scale` ((1,)) when activations are static.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flashvlm.kernels.dispatch import use_triton
from flashvlm.kernels.int8_torch import int_mm_applies, int_mm_w8a8, quantize_weight_per_channel, w8a8_reference
from flashvlm.quant.base import QuantFormatError, QuantizedLinear, QuantMethod, frozen, out_sizes_of
from flashvlm.quant.compressed_int8 import scheme_from_compressed_tensors

_SYMMETRIC_ZERO_POINTS = ("weight_zero_point", "input_zero_point")


@dataclass(frozen=True)
class Int8Scheme:
    """int8 symmetric weights per output channel; int8 symmetric activations."""

    static_activations: bool = False
    """False: a scale per token, from its amax, at run time. True: the checkpoint's per-tensor input_scale."""

    def describe(self) -> dict[str, str]:
        acts = "int8 per-tensor static" if self.static_activations else "int8 per-token dynamic"
        return {"weights": "int8 per-channel symmetric", "activations": acts}


class Int8Linear(QuantizedLinear):
    """A W8A8 linear layer. Parameters as the checkpoint names them: `weight` int8 (N, K), `weight_scale` float32
    (N, 1), with static activations `input_scale` float32, one per projection it was merged from."""

    method = "int8"

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str, scheme: Int8Scheme) -> None:
        super().__init__(in_features, out_sizes, bias, dtype, device)
        self.scheme = scheme
        n = self.out_features
        self.weight = frozen(torch.empty(n, in_features, dtype=torch.int8, device=device))
        self.weight_scale = frozen(torch.empty(n, 1, dtype=torch.float32, device=device))
        if scheme.static_activations:
            self.input_scale = frozen(torch.empty(len(self.out_sizes), dtype=torch.float32, device=device))
        else:
            self.register_parameter("input_scale", None)
        self.register_buffer("x_scale", None, persistent=False)
        """The activations' static scale the kernels use (finish_loading); None: dynamic per token."""

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        if param_name in _SYMMETRIC_ZERO_POINTS:
            # Older compressed-tensors releases saved the zero points of symmetric schemes, all zeros; anything
            # else would be an asymmetric checkpoint mislabelled symmetric.
            if tensor.any():
                raise QuantFormatError(f"{param_name} of shard {shard} is non-zero in a checkpoint declared "
                                       "symmetric")
            return
        if param_name == "input_scale" and self.input_scale is not None:
            if tensor.numel() != 1:
                raise QuantFormatError(f"input_scale of shard {shard} has {tensor.numel()} values; static int8 "
                                       "activations take one per-tensor scale")
            self.input_scale.data[shard] = tensor.reshape(())
            return
        super().load_shard(param_name, shard, tensor)

    def finish_loading(self) -> None:
        """Static scales of merged projections (q, k, v) read one input: it is quantized with the largest of their
        scales, so no projection's input clips more than its own scale would clip it."""
        if self.input_scale is not None:
            scale = self.input_scale.detach().amax().reshape(1).float()
            if not bool(scale > 0) or not bool(torch.isfinite(scale)):
                raise QuantFormatError(f"input_scale {scale.item()} of a static int8 layer is not a positive number")
            self.x_scale = scale

    def dequantized_weight(self) -> torch.Tensor:
        """float32 (N, K): what the integer weights stand for (references and tests)."""
        return self.weight.float() * self.weight_scale.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        m, n = x2.shape[0], self.out_features
        w_scale = self.weight_scale.view(-1)
        kernels = use_triton(x2, self.use_triton_kernels)
        if 0 < m <= self.gemv_max_rows and kernels:
            from flashvlm.kernels.int8_gemv import w8a8_gemv  # lazy: Triton loads on the first kernel call

            out = w8a8_gemv(x2, self.weight, w_scale, self.bias, x_scale=self.x_scale, locks=self.gemv_locks)
        elif m > 0 and x2.is_cuda and int_mm_applies(n, self.in_features):
            if kernels:
                from flashvlm.kernels.int8_gemv import dequantize_product_triton, quantize_rows

                out = int_mm_w8a8(x2, self.weight, w_scale, self.bias, x_scale=self.x_scale, quantize=quantize_rows,
                                  epilogue=dequantize_product_triton)
            else:
                out = int_mm_w8a8(x2, self.weight, w_scale, self.bias, x_scale=self.x_scale)
        else:
            out = w8a8_reference(x2, self.weight, w_scale, self.bias, x_scale=self.x_scale)
        return out.reshape(*lead, n)

    def describe(self) -> dict[str, Any]:
        return {"method": self.method, **self.scheme.describe()}


def _float_weight(layer: nn.Module) -> torch.Tensor:
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise QuantFormatError(f"int8 quantizes float linear layers, not a {type(layer).__name__}")
    return weight


class Int8Method(QuantMethod):
    name = "int8"

    def default_scheme(self) -> Int8Scheme:
        return Int8Scheme()

    def scheme_from_checkpoint(self, quant_config: dict[str, Any]) -> Int8Scheme | None:
        static = scheme_from_compressed_tensors(quant_config)
        return None if static is None else Int8Scheme(static_activations=static)

    def is_quantized_tensor(self, checkpoint_name: str) -> bool:
        return checkpoint_name.endswith(".weight_scale")

    def empty_layer(self, layer: nn.Module, scheme: Int8Scheme) -> Int8Linear:
        weight = _float_weight(layer)
        return Int8Linear(weight.shape[1], out_sizes_of(layer), layer.bias is not None, weight.dtype,
                          weight.device, scheme)

    @torch.no_grad()
    def quantize(self, layer: nn.Module, scheme: Int8Scheme) -> Int8Linear:
        if scheme.static_activations:
            raise QuantFormatError("static int8 activation scales come from calibration: --quantization int8 "
                                   "quantizes activations per token")
        new = self.empty_layer(layer, scheme)
        q, scale = quantize_weight_per_channel(_float_weight(layer))
        new.weight.copy_(q)
        new.weight_scale.copy_(scale[:, None])
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
        return new
