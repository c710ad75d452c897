"""What an FP8 checkpoint declares: the FP8 scheme (`Fp8Scheme`) and the parsing of the two on-disk formats that
carry one, compressed-tensors (what llm-compressor writes) and transformers' own block-wise `fp8`. A variant either
format can express but flashvlm cannot run is refused here, at load, with a QuantFormatError naming it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashvlm.quant.base import QuantFormatError

WEIGHT_GRANULARITIES = ("channel", "tensor", "channel+tensor", "block")
ACTIVATIONS = ("dynamic", "static", None)


@dataclass(frozen=True)
class Fp8Scheme:
    """E4M3 weights with float32 scales; how the activations enter the product."""

    weight: str = "channel"
    """channel: a scale per output row; tensor: one per checkpoint projection (expanded over its rows, so the layer
    runs per channel, exactly); channel+tensor: a checkpoint whose groups use both; block: a scale per
    `block` = (rows, columns) tile of the weight."""
    activation: str | None = "dynamic"
    """dynamic: quantized to e4m3 at run time, one scale per token (per token and `block` column group for block
    weights) = amax / 448; static: one calibrated scale per layer (the checkpoint's `input_scale`); None: weight-only,
    the activations stay in the model dtype and the weight is dequantized in the product."""
    block: tuple[int, int] | None = None
    """(rows, columns) of a weight scale's tile; block weights only."""
    block_scale_name: str = "weight_scale_inv"
    """The checkpoint's name of the block scales: transformers writes `weight_scale_inv`, compressed-tensors
    `weight_scale` (both multiply the e4m3 values)."""

    def __post_init__(self) -> None:
        if self.weight not in WEIGHT_GRANULARITIES:
            raise QuantFormatError(f"fp8 weight granularity {self.weight!r} is not one of {WEIGHT_GRANULARITIES}")
        if self.activation not in ACTIVATIONS:
            raise QuantFormatError(f"fp8 activation scheme {self.activation!r} is not one of {ACTIVATIONS}")
        if (self.weight == "block") != (self.block is not None):
            raise QuantFormatError("fp8 block weights need a block size, and only block weights take one")
        if self.weight == "block" and self.activation == "static":
            raise QuantFormatError("fp8 block weights with static activation scales are not supported")

    @property
    def activation_group(self) -> int | None:
        """Columns per dynamic activation scale: the weight block's columns for block weights (so every scale of a
        product's K block is one activation scale times one weight scale), else None (the whole row)."""
        return self.block[1] if self.weight == "block" and self.activation == "dynamic" else None


def _fmt(args: dict[str, Any]) -> str:
    keys = ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size", "block_structure")
    return "{" + ", ".join(f"{k}={args.get(k)!r}" for k in keys if k in args) + "}"


# compressed-tensors preset names a config may use instead of spelling the scheme out (llm-compressor itself
# writes the expanded form); the FP8 ones, as compressed_tensors' quant_scheme.py defines them.
_FP8_PRESETS: dict[str, dict[str, Any]] = {
    "FP8": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                                  "dynamic": False}},
    "FP8_DYNAMIC": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                          "dynamic": True}},
    "FP8_BLOCK": {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "symmetric": True,
                              "dynamic": False, "block_structure": [128, 128]},
                  "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "symmetric": True,
                                        "dynamic": True, "group_size": 128}},
}
_RUNNABLE_FORMATS = ("float-quantized", "naive-quantized")
"""float-quantized: FP8 weights with FP8 activations; naive-quantized: what compressed-tensors names FP8 weight-only
checkpoints (its float-quantized compressor needs input activations). Both store `weight` as e4m3 values."""


def _groups(qc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name, group in (qc.get("config_groups") or {}).items():
        if isinstance(group, list):  # a preset name mapped to its targets
            if name.upper() not in _FP8_PRESETS:
                if name.upper().startswith(("FP8", "MXFP", "NVFP")):
                    raise QuantFormatError(f"compressed-tensors preset scheme {name!r} is not one flashvlm runs "
                                           f"(FP8 presets: {', '.join(_FP8_PRESETS)})")
                continue
            group = _FP8_PRESETS[name.upper()]
        out[name] = group
    return out


def _is_float_weight(group: dict[str, Any]) -> bool:
    return (group.get("weights") or {}).get("type") == "float"


def _weight_granularity(name: str, w: dict[str, Any]) -> tuple[str, tuple[int, int] | None]:
    where = f"compressed-tensors group {name!r} weights {_fmt(w)}"
    if w.get("num_bits") != 8:
        raise QuantFormatError(f"{where}: {w.get('num_bits')}-bit float weights (NVFP4/MXFP4) are not supported; "
                               "flashvlm runs 8-bit (e4m3) float weights")
    if not w.get("symmetric", True):
        raise QuantFormatError(f"{where}: asymmetric fp8 weights (a zero point) are not supported")
    if w.get("dynamic"):
        raise QuantFormatError(f"{where}: dynamic weight scales are not supported")
    strategy = w.get("strategy")
    if strategy in ("channel", "tensor"):
        return strategy, None
    if strategy == "block":
        block = w.get("block_structure")
        if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
            raise QuantFormatError(f"{where}: block strategy without a valid block_structure")
        return "block", (int(block[0]), int(block[1]))
    raise QuantFormatError(f"{where}: the {strategy!r} strategy for fp8 weights is not supported "
                           "(flashvlm runs channel, tensor and block)")


def _activation(name: str, a: dict[str, Any] | None, block: tuple[int, int] | None) -> str | None:
    if a is None:
        return None
    where = f"compressed-tensors group {name!r} input_activations {_fmt(a)}"
    if a.get("type") != "float" or a.get("num_bits") != 8 or not a.get("symmetric", True):
        raise QuantFormatError(f"{where}: flashvlm runs fp8 weights with symmetric 8-bit float activations only")
    strategy, dynamic = a.get("strategy"), a.get("dynamic")
    if block is None and strategy == "token" and dynamic is True:
        return "dynamic"
    if block is None and strategy == "tensor" and dynamic is False:
        return "static"
    if block is not None and strategy == "group" and dynamic is True and a.get("group_size") == block[1]:
        return "dynamic"
    raise QuantFormatError(f"{where}: not supported with {'block' if block else 'channel/tensor'} weights "
                           "(flashvlm runs dynamic per token or static per tensor activations, and dynamic groups "
                           "of the weight block's columns with block weights)")


def _scheme_of_group(name: str, group: dict[str, Any], qc_format: str | None) -> Fp8Scheme:
    fmt = group.get("format") or qc_format
    if fmt not in _RUNNABLE_FORMATS:
        raise QuantFormatError(f"compressed-tensors group {name!r} is stored as {fmt!r}; flashvlm loads fp8 "
                               f"weights stored as {' or '.join(_RUNNABLE_FORMATS)}")
    if group.get("output_activations") is not None:
        raise QuantFormatError(f"compressed-tensors group {name!r}: output activation quantization is not "
                               "supported")
    weight, block = _weight_granularity(name, group["weights"])
    activation = _activation(name, group.get("input_activations"), block)
    if block is not None:
        return Fp8Scheme("block", activation, block, block_scale_name="weight_scale")
    return Fp8Scheme(weight, activation)


def _merge(schemes: dict[str, Fp8Scheme]) -> Fp8Scheme:
    """One scheme for every fp8 layer: groups may differ in channel vs tensor weight scales (both run per
    channel), not in anything else, since a layer's tensors are allocated before the loader says which group it
    belongs to."""
    first = next(iter(schemes.values()))
    weights = {s.weight for s in schemes.values()}
    others = {(s.activation, s.block) for s in schemes.values()}
    if len(others) > 1 or (len(weights) > 1 and "block" in weights):
        shown = "; ".join(f"{n}: {s}" for n, s in schemes.items())
        raise QuantFormatError(f"the checkpoint's compressed-tensors groups use different fp8 schemes ({shown}); "
                               "flashvlm runs groups that differ only in channel vs tensor weight scales")
    weight = first.weight if len(weights) == 1 else "channel+tensor"
    return Fp8Scheme(weight, first.activation, first.block, first.block_scale_name)


def compressed_tensors_scheme(qc: dict[str, Any]) -> Fp8Scheme | None:
    """The scheme of a compressed-tensors checkpoint whose weights are float; None when they are not (int8/int4)."""
    groups = _groups(qc)
    floats = {n: g for n, g in groups.items() if _is_float_weight(g)}
    if not floats:
        return None
    if len(floats) != len(groups):
        mixed = ", ".join(f"{n}: {(g.get('weights') or {}).get('type')}" for n, g in groups.items())
        raise QuantFormatError(f"the checkpoint's compressed-tensors groups mix float and other weights ({mixed}); "
                               "flashvlm runs one quantization method per model")
    return _merge({n: _scheme_of_group(n, g, qc.get("format")) for n, g in floats.items()})


def transformers_fp8_scheme(qc: dict[str, Any]) -> Fp8Scheme:
    """transformers' `quant_method: fp8` (FineGrainedFP8Config): e4m3 weights with a float32 (or power-of-two
    ue8m0) scale per weight block, `weight_scale_inv`; activations quantized per token and block column group."""
    activation = str(qc.get("activation_scheme", "dynamic")).lower()
    if activation != "dynamic":
        raise QuantFormatError(f"transformers fp8 checkpoint with activation_scheme {activation!r}: flashvlm runs "
                               "its dynamic activations only")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(int(b) > 0 for b in block)):
        raise QuantFormatError(f"transformers fp8 checkpoint with weight_block_size {block!r}: flashvlm runs "
                               "block-wise scales ([rows, columns], e.g. [128, 128])")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise QuantFormatError(f"transformers fp8 checkpoint with scale_fmt {scale_fmt!r} is not supported")
    return Fp8Scheme("block", "dynamic", (int(block[0]), int(block[1])), block_scale_name="weight_scale_inv")
