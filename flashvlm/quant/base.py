"""The contract of a weight-quantization method and of the layers it builds.

A method turns a float linear layer (`layers/linear.py`: Linear, MergedLinear, PlainLinear) into a
`QuantizedLinear` in one of two ways: `quantize` rounds the float weights it is handed (`--quantization NAME` on a
bf16 checkpoint, or random weights for benchmarks), `empty_layer` allocates the tensors a pre-quantized checkpoint
stores, under the checkpoint's own names, for the loader to fill. Either way the new layer keeps the old one's
input size, output split and bias, so the model code around it is unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from torch import nn

from flashvlm.config import ConfigError
from flashvlm.layers.linear import GEMV_MAX_ROWS, gemv_locks


class QuantFormatError(ConfigError):
    """A quantized checkpoint format or scheme flashvlm cannot run (raised at load, naming it)."""


def out_sizes_of(layer: nn.Module) -> list[int]:
    """The output split of a float linear layer: a MergedLinear's shards, else one block."""
    sizes = getattr(layer, "out_sizes", None)
    return list(sizes) if sizes else [int(layer.out_features)]


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """A parameter that is never trained: quantized weights and their scales (integer and fp8 dtypes need it)."""
    return nn.Parameter(tensor, requires_grad=False)


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored quantized.

    Subclasses register their tensors as frozen parameters named as the checkpoint names them (`weight`,
    `weight_scale`, `weight_packed`, ...), so the loader fills them like any parameter, and implement `forward`.
    A layer built from several checkpoint projections (qkv, gate/up) receives each through `load_shard`; the
    default slices every parameter along its first dimension in proportion to the output rows, which fits tensors
    laid out by output channel (weights, per-channel or per-group scales, zero points packed along the output).
    Tensors with another layout (a per-tensor scale per projection) override `load_shard`.
    """

    method: ClassVar[str] = ""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features = int(in_features)
        self.out_sizes = [int(s) for s in out_sizes]
        self.out_features = sum(self.out_sizes)
        self.dtype = dtype
        """Dtype of the activations in and out (the model's dtype)."""
        if bias:
            self.bias = frozen(torch.empty(self.out_features, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        self.use_triton_kernels = True
        """Triton kernels on CUDA tensors; the engine sets it from EngineConfig.kernel_backend."""
        self.gemv_max_rows = GEMV_MAX_ROWS
        """Products of at most this many rows take the low-row kernel; the engine sets 0 for decode_gemv=False."""
        # The low-row kernels' split-K arrival counters (16 output columns is the narrowest column block any of
        # them uses too), zeros between calls; each layer owns its own, so no two products in flight share them.
        self.register_buffer("gemv_locks", gemv_locks(self.out_features, device), persistent=False)

    # ---- what model code calls ------------------------------------------------------------------
    def split_output(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return out.split(self.out_sizes, dim=-1)

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) in self.dtype -> (..., out_features) in self.dtype."""

    # ---- loading --------------------------------------------------------------------------------
    def load_shard(self, param_name: str, shard: int, tensor: torch.Tensor) -> None:
        param = getattr(self, param_name)
        if param is None:
            raise ValueError(f"{type(self).__name__} has no tensor {param_name!r}")
        rows_per_out = param.shape[0] / self.out_features
        start = sum(self.out_sizes[:shard]) * rows_per_out
        size = self.out_sizes[shard] * rows_per_out
        if start != int(start) or size != int(size):
            raise ValueError(f"{param_name}: shard {shard} of {self.out_sizes} does not fall on whole rows of a "
                             f"{tuple(param.shape)} tensor")
        target = param.data[int(start):int(start + size)]
        if target.shape != tensor.shape:
            raise ValueError(f"shard {shard} of {param_name}: expected {tuple(target.shape)}, "
                             f"got {tuple(tensor.shape)}")
        target.copy_(tensor)

    def load_tensor(self, param_name: str, tensor: torch.Tensor) -> None:
        """A checkpoint tensor of a layer that is one projection (the loader calls it instead of copying, so a
        layer may take tensors whose stored shape differs from its own, e.g. a scale saved as () or (1,))."""
        param = getattr(self, param_name)
        if param is None or param.shape != tensor.shape:
            raise ValueError(f"{type(self).__name__}.{param_name}: checkpoint shape {tuple(tensor.shape)} != "
                             f"{None if param is None else tuple(param.shape)}")
        param.data.copy_(tensor)

    def finish_loading(self) -> None:
        """Called once every tensor is in: repack for the kernels, fold per-projection scales. Default: nothing."""

    # ---- reporting ------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """What this layer runs, for results.json: method, weight format, activation format."""
        return {"method": self.method}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_sizes={self.out_sizes}, bias={self.bias is not None}"


class QuantMethod(ABC):
    """One quantization method (a registry entry): builds its layers and reads its checkpoint formats."""

    name: ClassVar[str]

    @abstractmethod
    def default_scheme(self) -> Any:
        """The scheme `--quantization <name>` applies to a float checkpoint (a frozen dataclass)."""

    def scheme_from_checkpoint(self, quant_config: dict[str, Any]) -> Any | None:
        """The scheme of a checkpoint's `quantization_config` when this method runs it, else None. Raise
        QuantFormatError for a format this method owns but a variant of it that it cannot run."""
        return None

    @abstractmethod
    def is_quantized_tensor(self, checkpoint_name: str) -> bool:
        """Whether a checkpoint tensor marks its layer as stored quantized (e.g. a `.weight_scale`)."""

    @abstractmethod
    def quantize(self, layer: nn.Module, scheme: Any) -> QuantizedLinear:
        """Round a float layer's weights (round to nearest, no calibration data)."""

    @abstractmethod
    def empty_layer(self, layer: nn.Module, scheme: Any) -> QuantizedLinear:
        """A layer shaped like the checkpoint's tensors for `layer`, to be filled by the loader."""
