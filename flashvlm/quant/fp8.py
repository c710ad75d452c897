"""FP8 (e4m3) weights: `--quantization fp8` on a float checkpoint (a scale per output channel, activations rounded
per token at run time, as vLLM's fp8 and llm-compressor's FP8_DYNAMIC do), and pre-quantized FP8 checkpoints loaded
as they are (`fp8_formats.py`). The layer and its kernels are in `fp8_linear.py`, its numbers in `fp8_math.py`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flashvlm.quant.base import QuantFormatError, QuantMethod, out_sizes_of
from flashvlm.quant.fp8_formats import Fp8Scheme, compressed_tensors_scheme, transformers_fp8_scheme
from flashvlm.quant.fp8_linear import Fp8Linear
from flashvlm.quant.fp8_math import quantize_blocks, round_e4m3, scale_of

_QUANTIZED_SUFFIXES = (".weight_scale", ".weight_scale_inv")


class Fp8Method(QuantMethod):
    name = "fp8"

    def default_scheme(self) -> Fp8Scheme:
        return Fp8Scheme("channel", "dynamic")

    def scheme_from_checkpoint(self, quant_config: dict[str, Any]) -> Fp8Scheme | None:
        method = quant_config.get("quant_method")
        if method == "compressed-tensors":
            return compressed_tensors_scheme(quant_config)
        if method == "fp8":
            return transformers_fp8_scheme(quant_config)
        return None

    def is_quantized_tensor(self, checkpoint_name: str) -> bool:
        return checkpoint_name.endswith(_QUANTIZED_SUFFIXES)

    def empty_layer(self, layer: nn.Module, scheme: Fp8Scheme) -> Fp8Linear:
        return Fp8Linear(layer.in_features, out_sizes_of(layer), layer.bias is not None, layer.weight.dtype,
                         layer.weight.device, scheme)

    @torch.no_grad()
    def quantize(self, layer: nn.Module, scheme: Fp8Scheme) -> Fp8Linear:
        """Round a float layer's weights: channel (amax of each row / 448), tensor (amax of each projection's
        rows / 448, expanded over them) or block (amax of each tile / 448, e.g. random weights benchmarked with a
        block-scaled checkpoint's config). Static activation scales need calibration, so a checkpoint."""
        if scheme.activation == "static":
            raise QuantFormatError(f"fp8 with static activation scales ({scheme}) needs a pre-quantized checkpoint "
                                   "holding its calibrated input_scale; --quantization fp8 rounds activations "
                                   "dynamically")
        new = self.empty_layer(layer, scheme)
        weight = layer.weight.float()
        if scheme.block is not None:
            for shard, part in enumerate(weight.split(new.out_sizes)):
                q, scale = quantize_blocks(part, scheme.block)
                new.load_shard("weight", shard, q)
                new.load_shard(scheme.block_scale_name, shard, scale)
            new.finish_loading()
        else:
            amax = weight.abs().amax(dim=1)
            if scheme.weight == "tensor":
                amax = torch.cat([part.amax().expand(len(part)) for part in amax.split(new.out_sizes)])
            scale = scale_of(amax)
            new.weight.copy_(round_e4m3(weight, scale[:, None]))
            new.weight_scale.copy_(scale)
        if layer.bias is not None:
            new.bias.copy_(layer.bias)
        new.use_triton_kernels = getattr(layer, "use_triton_kernels", True)
        new.gemv_max_rows = getattr(layer, "gemv_max_rows", new.gemv_max_rows)
        return new
