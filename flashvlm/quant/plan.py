"""What a model's weights are quantized with, and where that comes from: the checkpoint's own
`quantization_config` (a pre-quantized checkpoint, loaded as it is) or `--quantization` on a float checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

from flashvlm.config import ConfigError
from flashvlm.quant.base import QuantFormatError
from flashvlm.quant.registry import QUANTIZATION_CHOICES, all_methods, get_method


@dataclass(frozen=True)
class QuantPlan:
    method: str
    """Registry name of the method (fp8, int8, int4)."""
    scheme: Any
    """The method's frozen scheme dataclass (bits, granularity, group size, activation handling)."""
    prequantized: bool
    """The checkpoint stores quantized tensors; False: float weights are rounded at load."""
    source: str
    """Where the plan came from, for logs and results.json."""
    quantize_vision: bool = False
    """Float checkpoints: also quantize the vision tower and projector (pre-quantized: as the checkpoint is)."""

    def to_dict(self) -> dict[str, Any]:
        scheme = asdict(self.scheme) if is_dataclass(self.scheme) else repr(self.scheme)
        return {"method": self.method, "scheme": scheme, "prequantized": self.prequantized, "source": self.source,
                "quantize_vision": self.quantize_vision}


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any] | None:
    """The checkpoint's quantization_config as a plain dict (transformers may hold it as an object)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if hasattr(qc, "to_dict"):
        qc = qc.to_dict()
    return dict(qc) if isinstance(qc, dict) else None


def _weights_quantized(qc: dict[str, Any]) -> bool:
    """compressed-tensors checkpoints may quantize only the KV cache (no config_groups): weights stay float."""
    return not (qc.get("quant_method") == "compressed-tensors" and not qc.get("config_groups"))


def _summary(qc: dict[str, Any]) -> str:
    keys = ("quant_method", "format", "config_groups", "weight_block_size", "bits", "group_size")
    shown = {k: qc[k] for k in keys if k in qc}
    return json.dumps(shown, default=str)[:400]


def plan_from_checkpoint(qc: dict[str, Any]) -> QuantPlan | None:
    if not _weights_quantized(qc):
        return None
    for method in all_methods():
        scheme = method.scheme_from_checkpoint(qc)
        if scheme is not None:
            fmt = qc.get("format")
            source = f"checkpoint ({qc.get('quant_method')}" + (f", {fmt})" if fmt else ")")
            return QuantPlan(method.name, scheme, prequantized=True, source=source)
    raise QuantFormatError(
        f"the checkpoint's quantization_config is a format flashvlm cannot run: {_summary(qc)}. flashvlm runs "
        "compressed-tensors float-quantized FP8 (channel or tensor weight scales), int-quantized W8A8 INT8 and "
        "pack-quantized W4A16 (group 32/64/128), and transformers' block-wise fp8 (docs/quantization.md)")


def resolve_plan(quantization: str | None, hf_config: Any, quantize_vision: bool = False) -> QuantPlan | None:
    """The checkpoint's own quantization wins; --quantization must then name the same method (or be unset)."""
    qc = checkpoint_quant_config(hf_config)
    plan = plan_from_checkpoint(qc) if qc else None
    if plan is not None:
        if quantization is not None and quantization != plan.method:
            raise ConfigError(f"the checkpoint is already quantized ({plan.method}, {plan.source}); "
                              f"--quantization {quantization} cannot re-quantize it: drop the flag")
        if quantize_vision:
            raise ConfigError("--quantize-vision applies to float checkpoints; a pre-quantized checkpoint runs "
                              "the layers it quantized, as it is")
        return plan
    if quantization is None:
        if quantize_vision:
            raise ConfigError("--quantize-vision needs --quantization")
        return None
    if quantization not in QUANTIZATION_CHOICES:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    method = get_method(quantization)
    return QuantPlan(method.name, method.default_scheme(), prequantized=False,
                     source=f"--quantization {quantization}", quantize_vision=quantize_vision)
