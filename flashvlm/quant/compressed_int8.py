"""Reading compressed-tensors' INT8 W8A8 (`int-quantized`) quantization_config, as llm-compressor writes it:

    {"quant_method": "compressed-tensors", "format": "int-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
         "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": true, "dynamic": false},
         "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": true,
                               "dynamic": true}}},
     "ignore": ["lm_head", "re:.*visual.*"]}

A config is ours when its weights are 8-bit integers. The variants we run: channel weight scales, symmetric; the
activations dynamic per token, or static with a per-tensor scale. Everything else that claims int8 weights is
refused here by name, so the user learns what their checkpoint holds rather than meeting a shape error.
"""

from __future__ import annotations

from typing import Any

from flashvlm.quant.base import QuantFormatError

_FORMATS = ("int-quantized", "naive-quantized")
"""The two names compressed-tensors gives the same layout (int8 `weight` + `weight_scale`); int8 weights packed
into int32 (`pack-quantized`, llm-compressor's W8A16) belong to the int4 method's reader."""


def _is_int8_weights(group: dict[str, Any]) -> bool:
    weights = group.get("weights") or {}
    return weights.get("type", "int") == "int" and int(weights.get("num_bits", 8)) == 8


def _refuse(what: str) -> QuantFormatError:
    return QuantFormatError(f"compressed-tensors INT8 checkpoint with {what}: flashvlm runs int8 W8A8 with "
                            "symmetric per-channel weight scales and symmetric int8 activations, dynamic per "
                            "token or static per tensor (docs/quantization.md)")


def _strategy(args: dict[str, Any]) -> str | None:
    """The strategy as compressed-tensors infers it when unset: from group_size (none: tensor, -1: channel)."""
    strategy = args.get("strategy")
    if strategy is not None:
        return strategy
    group_size = args.get("group_size")
    if group_size is None:
        return "tensor"
    return "channel" if group_size == -1 else "group"


def _check_weights(weights: dict[str, Any]) -> None:
    if not weights.get("symmetric", True):
        raise _refuse("asymmetric weights (weight_zero_point)")
    strategy = _strategy(weights)
    if strategy != "channel":
        raise _refuse(f"{strategy!r} weight scales (group_size={weights.get('group_size')}), not 'channel'")
    if weights.get("dynamic"):
        raise _refuse("dynamic weight scales")


def _activations_static(acts: dict[str, Any] | None) -> bool:
    if not acts:
        raise _refuse("no input_activations (W8A16, weight-only int8)")
    if acts.get("type", "int") != "int" or int(acts.get("num_bits", 8)) != 8:
        raise _refuse(f"{acts.get('num_bits')}-bit {acts.get('type')} input activations")
    if not acts.get("symmetric", True):
        raise _refuse("asymmetric input activations (input_zero_point)")
    strategy, dynamic = _strategy(acts), acts.get("dynamic", False)
    if dynamic is True and strategy == "token":
        return False
    if dynamic is False and strategy == "tensor":
        return True
    raise _refuse(f"input activations with strategy={strategy!r}, dynamic={dynamic!r}")


def scheme_from_compressed_tensors(qc: dict[str, Any]) -> bool | None:
    """None when the config is not compressed-tensors with int8 weights; else whether activations are static.
    Raises QuantFormatError for an int8 variant flashvlm cannot run."""
    if qc.get("quant_method") != "compressed-tensors":
        return None
    groups = qc.get("config_groups") or {}
    ours = {name: g for name, g in groups.items() if isinstance(g, dict) and _is_int8_weights(g)}
    if not ours:
        return None
    if len(ours) != len(groups):
        raise _refuse(f"config groups of several schemes ({', '.join(sorted(groups))})")
    fmt = qc.get("format")
    if fmt == "pack-quantized":
        return None  # int32-packed weights of any width are the int4 method's format
    statics = set()
    for group in ours.values():
        group_fmt = group.get("format") or fmt
        if group_fmt not in _FORMATS:
            raise _refuse(f"format {group_fmt!r} (flashvlm reads int8 as 'int-quantized')")
        if group.get("output_activations"):
            raise _refuse("quantized output activations")
        _check_weights(group["weights"])
        statics.add(_activations_static(group.get("input_activations")))
    if len(statics) > 1:
        raise _refuse("static activations in some groups and dynamic in others")
    return statics.pop()
