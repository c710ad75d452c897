"""The FP8 linear layer: e4m3 weights with float32 scales, loaded as a checkpoint stores them and folded into one
run-time layout, and its forward paths (`fp8_math.fp8_linear_reference` on the CPU, torch._scaled_mm and the
Triton FP8 GEMV on CUDA).

Run-time layout (after `finish_loading`): `weight` (N, K) float8_e4m3fn; `weight_scale` float32, (N,) for channel
and tensor weights (a tensor scale is expanded over its projection's rows: exact) or (N, ceil(K / block columns))
for block weights (each row block's scales repeated over its rows: exact, and merged projections whose row blocks
do not line up need no special case); `input_scale` (1,) float32 for static activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from flashvlm.kernels.dispatch import use_triton
from flashvlm.quant.base import QuantFormatError, QuantizedLinear, frozen
from flashvlm.quant.fp8_formats import Fp8Scheme
from flashvlm.quant.fp8_math import E4M3, dequantize_weight, fp8_linear_reference, quantize_activation

_HALF = (torch.bfloat16, torch.float16)


@functools.cache
def _fp8_gemv() -> Callable[..., torch.Tensor] | None:
    """The Triton FP8 GEMV when its module is there (imported on the first CUDA call; CPU never needs it)."""
    try:
        from flashvlm.kernels.fp8_gemv import fp8_gemv
    except ImportError:
        return None
    return fp8_gemv


@functools.cache
def _fp8_quantizer() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The Triton per-token quantizer (one launch where the torch expression takes several), imported lazily."""
    try:
        from flashvlm.kernels.fp8_quant import quantize_fp8_per_token
    except ImportError:
        return None
    return quantize_fp8_per_token


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Fp8Linear(QuantizedLinear):
    method = "fp8"

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str, scheme: Fp8Scheme) -> None:
        super().__init__(in_features, out_sizes, bias, dtype, device)
        self.scheme = scheme
        n, k = self.out_features, self.in_features
        self.weight = frozen(torch.empty(n, k, dtype=E4M3, device=device))
        self.block_cols = scheme.block[1] if scheme.block else None
        if scheme.block is None:
            self.weight_scale = frozen(torch.empty(n, dtype=torch.float32, device=device))
        else:
            # Each projection's (ceil(rows / block rows), ceil(K / block cols)) scales, stacked in shard order.
            rows = sum(_cdiv(s, scheme.block[0]) for s in self.out_sizes)
            self.register_parameter(scheme.block_scale_name, frozen(
                torch.empty(rows, _cdiv(k, scheme.block[1]), dtype=torch.float32, device=device)))
        if scheme.activation == "static":
            # One per projection while loading; finish_loading keeps their maximum.
            self.input_scale = frozen(torch.empty(len(self.out_sizes), dtype=torch.float32, device=device))
        else:
            self.register_parameter("input_scale", None)
        self.folded = False
        """Whether finish_loading has put the checkpoint's tensors into the run-time layout."""

    # ---- loading --------------------------------------------------------------------------------
    def load_tensor(self, param_name: str, tensor: torch.Tensor) -> None:
        self.load_shard(param_name, 0, tensor)

    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        start, size = sum(self.out_sizes[:shard]), self.out_sizes[shard]
        if param_name == "weight" and tensor.dtype != E4M3:
            raise QuantFormatError(f"fp8 weight stored as {tensor.dtype}: flashvlm runs float8_e4m3fn weights "
                                   "(e5m2 and other encodings are not supported)")
        if param_name == "weight_scale" and self.scheme.block is None:
            # (rows, 1) or (rows,) per channel, or one value per projection (per tensor) expanded over its rows.
            if tensor.numel() not in (1, size):
                raise ValueError(f"weight_scale of shard {shard}: {tuple(tensor.shape)} is neither one scale nor "
                                 f"one per each of its {size} rows")
            self.weight_scale.data[start:start + size].copy_(tensor.reshape(-1).float().expand(size))
        elif param_name == "input_scale" and self.input_scale is not None:
            if tensor.numel() != 1:
                raise ValueError(f"input_scale of shard {shard}: expected one value, got {tuple(tensor.shape)}")
            self.input_scale.data[shard].copy_(tensor.reshape(()))
        elif self.scheme.block is not None and param_name == self.scheme.block_scale_name:
            rows_per_block = self.scheme.block[0]
            first = sum(_cdiv(s, rows_per_block) for s in self.out_sizes[:shard])
            target = getattr(self, param_name).data[first:first + _cdiv(size, rows_per_block)]
            if target.shape != tensor.shape:
                raise ValueError(f"{param_name} of shard {shard}: expected {tuple(target.shape)} block scales, "
                                 f"got {tuple(tensor.shape)}")
            target.copy_(tensor)
        else:
            super().load_shard(param_name, shard, tensor)

    def finish_loading(self) -> None:
        if self.folded:
            return
        self.folded = True
        if self.input_scale is not None and self.input_scale.numel() > 1:
            # Merged projections (q/k/v, gate/up) share one input, so one activation scale must serve them all;
            # the largest covers every projection's calibrated range (no input overflows e4m3). llm-compressor
            # calibrates each projection on that same input, so their scales are equal and this is exact.
            self.input_scale = frozen(self.input_scale.data.amax().reshape(1))
        if self.scheme.block is not None:
            blocks = getattr(self, self.scheme.block_scale_name).data
            delattr(self, self.scheme.block_scale_name)
            rows, first = [], 0
            for size in self.out_sizes:
                count = _cdiv(size, self.scheme.block[0])
                rows.append(blocks[first:first + count].repeat_interleave(self.scheme.block[0], dim=0)[:size])
                first += count
            self.weight_scale = frozen(torch.cat(rows).contiguous())

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda and self.use_triton_kernels and x2.shape[0] > 0:
            out = self._forward_cuda(x2)
        else:
            out = fp8_linear_reference(x2, self.weight, self.weight_scale, self.bias,
                                       activation=self.scheme.activation, input_scale=self.input_scale,
                                       block_cols=self.block_cols)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.block is not None or self.scheme.activation is None:
            return self._forward_dequantized(x)
        gemv = _fp8_gemv()
        if (gemv is not None and x.dtype in _HALF and x.shape[0] <= self.gemv_max_rows
                and use_triton(x, self.use_triton_kernels)):
            return gemv(x, self.weight, self.weight_scale, self.bias, input_scale=self.input_scale,
                        locks=self.gemv_locks)
        if self.in_features % 16 or self.out_features % 16:
            return self._forward_dequantized(x)  # torch._scaled_mm takes K and N in multiples of 16
        return self._forward_scaled_mm(x)

    def _forward_scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        """cuBLAS FP8 with row-wise scales: (M, 1) per token times (1, N) per output channel, float32, into
        bfloat16 (the output type row-wise scaling supports); B = weight.t() is column-major as it requires."""
        quantizer = _fp8_quantizer() if x.dtype in _HALF and use_triton(x, self.use_triton_kernels) else None
        if quantizer is not None:
            q, scale = quantizer(x, input_scale=self.input_scale if self.scheme.activation == "static" else None)
        else:
            q, scale = quantize_activation(x, self.scheme.activation, self.input_scale)
        fused_bias = self.bias if self.dtype == torch.bfloat16 else None
        out = torch._scaled_mm(q, self.weight.t(), scale_a=scale.contiguous(),
                               scale_b=self.weight_scale.view(1, -1), bias=fused_bias, out_dtype=torch.bfloat16)
        out = out.to(self.dtype)
        if self.bias is not None and fused_bias is None:
            out = out + self.bias
        return out

    def _forward_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        """Weight-only and block-scaled weights on CUDA: the weight dequantized to the model dtype per call and the
        activations (when the scheme quantizes them) rounded and dequantized, then the library GEMM. Correct and
        memory-light, not fast: neither scheme has an exact load-time conversion to the per-channel layout the
        FP8 kernels take (block scales vary along K within a row; weight-only keeps x unrounded)."""
        # In the model dtype from the start (e4m3 values are exact in it), so the temporary weight is no wider than
        # a float layer's; the scale's rounding to that dtype is of the order of the product's own.
        w = dequantize_weight(self.weight, self.weight_scale, self.block_cols, dtype=x.dtype, compute_dtype=x.dtype)
        quantized = quantize_activation(x, self.scheme.activation, self.input_scale, self.scheme.activation_group)
        if quantized is not None:
            q, scale = quantized
            if self.scheme.activation_group is not None:
                scale = scale.repeat_interleave(self.scheme.activation_group, dim=1)[:, :x.shape[1]]
            x = (q.float() * scale).to(x.dtype)
        return F.linear(x, w, self.bias)

    # ---- reporting ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        s = self.scheme
        weight = {"channel": "e4m3 per channel", "tensor": "e4m3 per tensor (run per channel)",
                  "channel+tensor": "e4m3 per channel or tensor (run per channel)"}.get(
            s.weight, f"e4m3 per {s.block[0]}x{s.block[1]} block" if s.block else s.weight)
        activation = {"dynamic": "e4m3 dynamic per token" + (f" and {s.block[1]} columns" if s.block else ""),
                      "static": "e4m3 static per tensor"}.get(s.activation or "", str(self.dtype).split(".")[-1])
        return {"method": self.method, "weight": weight, "activation": activation}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scheme={self.scheme}"
