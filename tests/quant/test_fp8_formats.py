"""Reading FP8 schemes from quantization_config dicts (flashvlm/quant/fp8_formats.py): what runs, what is refused
and how the refusal names it."""

from __future__ import annotations

import copy

import pytest

from flashvlm.quant.base import QuantFormatError
from flashvlm.quant.fp8 import Fp8Method
from flashvlm.quant.fp8_formats import Fp8Scheme
from flashvlm.quant.plan import plan_from_checkpoint
from flashvlm.testing.quantized_fp8 import compressed_tensors_config


def _ct(weight: str = "channel", activation: str | None = "dynamic", **weight_overrides) -> dict:
    return compressed_tensors_config(weight, activation, ["lm_head"], weight_overrides or None)


def _scheme(qc: dict) -> Fp8Scheme | None:
    return Fp8Method().scheme_from_checkpoint(qc)


@pytest.mark.parametrize("weight,activation", [("channel", "dynamic"), ("channel", "static"), ("tensor", "static"),
                                               ("tensor", "dynamic"), ("channel", None), ("tensor", None)])
def test_llm_compressor_fp8_configs(weight, activation) -> None:
    assert _scheme(_ct(weight, activation)) == Fp8Scheme(weight, activation)
    plan = plan_from_checkpoint(_ct(weight, activation))
    assert plan.method == "fp8" and plan.prequantized


def test_groups_differing_in_weight_granularity_run_per_channel() -> None:
    qc = _ct("channel")
    qc["config_groups"]["group_1"] = copy.deepcopy(qc["config_groups"]["group_0"])
    qc["config_groups"]["group_1"]["weights"]["strategy"] = "tensor"
    assert _scheme(qc) == Fp8Scheme("channel+tensor", "dynamic")


def test_groups_differing_in_activations_are_refused() -> None:
    qc = _ct("channel", "dynamic")
    qc["config_groups"]["group_1"] = _ct("channel", "static")["config_groups"]["group_0"]
    with pytest.raises(QuantFormatError, match="different fp8 schemes"):
        _scheme(qc)


def test_presets_and_compressed_tensors_block() -> None:
    preset = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "config_groups": {"FP8_DYNAMIC": ["Linear"]}}
    assert _scheme(preset) == Fp8Scheme("channel", "dynamic")
    block = {**preset, "config_groups": {"FP8_BLOCK": ["Linear"]}}
    assert _scheme(block) == Fp8Scheme("block", "dynamic", (128, 128), block_scale_name="weight_scale")


def test_integer_checkpoints_are_not_fp8s() -> None:
    qc = _ct()
    qc["config_groups"]["group_0"]["weights"]["type"] = "int"
    qc["config_groups"]["group_0"]["input_activations"]["type"] = "int"
    qc["format"] = qc["config_groups"]["group_0"]["format"] = "int-quantized"
    assert _scheme(qc) is None


@pytest.mark.parametrize("change,message", [
    (lambda g: g["weights"].update(strategy="group", group_size=128), "'group' strategy"),
    (lambda g: g["weights"].update(symmetric=False), "asymmetric"),
    (lambda g: g["weights"].update(num_bits=4), "4-bit float weights"),
    (lambda g: g["input_activations"].update(strategy="tensor"), "input_activations"),
    (lambda g: g["input_activations"].update(type="int"), "input_activations"),
    (lambda g: g.update(output_activations=g["input_activations"]), "output activation"),
    (lambda g: g.update(format="pack-quantized"), "'pack-quantized'"),
])
def test_variants_flashvlm_cannot_run_are_refused_by_name(change, message) -> None:
    qc = _ct()
    change(qc["config_groups"]["group_0"])
    with pytest.raises(QuantFormatError, match=message):
        _scheme(qc)


def test_float_and_integer_groups_mixed_are_refused() -> None:
    qc = _ct()
    qc["config_groups"]["group_1"] = copy.deepcopy(qc["config_groups"]["group_0"])
    qc["config_groups"]["group_1"]["weights"]["type"] = "int"
    with pytest.raises(QuantFormatError, match="mix float"):
        _scheme(qc)


def test_transformers_fp8() -> None:
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert _scheme(qc) == Fp8Scheme("block", "dynamic", (128, 128))
    assert _scheme({**qc, "scale_fmt": "ue8m0"}).block == (128, 128)
    with pytest.raises(QuantFormatError, match="activation_scheme 'static'"):
        _scheme({**qc, "activation_scheme": "static"})
    with pytest.raises(QuantFormatError, match="weight_block_size None"):
        _scheme({**qc, "weight_block_size": None})


def test_other_methods_are_not_fp8s() -> None:
    assert _scheme({"quant_method": "awq", "bits": 4}) is None
    with pytest.raises(QuantFormatError, match="awq"):
        plan_from_checkpoint({"quant_method": "awq", "bits": 4})
