"""FP8 through the real loader and engine: `--quantization fp8` on a float checkpoint, pre-quantized
compressed-tensors and transformers fp8 checkpoints written in their on-disk formats (flashvlm/testing/
quantized_fp8.py), each against a plain-torch reference model of the same numbers; the formats flashvlm refuses."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.config import ConfigError
from flashvlm.quant.apply import float_targets
from flashvlm.quant.base import QuantFormatError
from flashvlm.testing.quantized_fp8 import (
    round_activation,
    write_compressed_tensors_fp8,
    write_dequantized,
    write_transformers_fp8,
)
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [{"prompt": IMG + "What is this?",
            "images": [np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)]},
           {"prompt": "Describe the image in one sentence."}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# One e4m3 rounding (3 mantissa bits) has a relative RMS error of about 2^-3 / sqrt(12) / 1.5 = 2.4%; a product
# rounds both operands (~3.4%), and independent errors of the quantized products a token passes through add in
# quadrature. The bound allows 1.5 times that.
_PRODUCT_ERROR = 0.034


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("float"), seed=31)


def _run(path, **kw) -> tuple[LLM, list[list[int]], list[torch.Tensor]]:
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024, **kw)
    return (llm, *_generate(llm))


def _generate(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    runner = llm.engine.runner
    runner.record_logits = True
    runner.recorded_logits.clear()
    outs = llm.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outs], [torch.stack(runner.recorded_logits[o.request_id]) for o in outs]


def _reference(quantized, tmp_path, activation: str | None, group: int | None = None, **kw) -> LLM:
    """The float model of a quantized checkpoint's weights (dequantized by the writer's code), each quantized
    linear layer's input rounded as the scheme says by a hook (static: with the layer's checkpoint input scale)."""
    llm = LLM(str(write_dequantized(quantized, tmp_path / "dequantized")), device="cpu", kv_cache_tokens=1024, **kw)
    model = llm.engine.model
    assert llm.engine.limits.quantization is None
    scales: dict[str, float] = {}
    if activation == "static":
        from safetensors import safe_open

        with safe_open(str(quantized / "model.safetensors"), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.endswith(".input_scale"):
                    module = model.checkpoint_module(name)
                    scales[module] = max(scales.get(module, 0.0), st.get_tensor(name).float().item())
    for name in float_targets(model, quantize_vision=False):
        model.get_submodule(name).register_forward_pre_hook(_rounding_hook(activation, scales.get(name), group))
    return llm


def _rounding_hook(activation: str | None, scale: float | None, group: int | None):
    def hook(module, args):
        return (round_activation(args[0], activation, scale, group).to(args[0].dtype),)

    return hook


def _assert_same_numbers(tokens, logits, ref_tokens, ref_logits) -> None:
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


# ---- --quantization fp8 -----------------------------------------------------------------------------------------
def test_quantization_fp8_runs_the_rounded_model(base, tmp_path) -> None:
    llm, tokens, logits = _run(base, quantization="fp8")
    summary = llm.engine.limits.quantization
    assert summary["method"] == "fp8" and summary["source"] == "--quantization fp8" and not summary["prequantized"]
    assert summary["num_quantized"] == 8  # qkv, o, gate_up, down in each of 2 layers
    assert summary["float_linear_roots"] == ["lm_head", "visual"]
    # The same numbers as the float model with weights rounded per channel and inputs per token (computed here)
    per_channel = write_compressed_tensors_fp8(base, tmp_path / "ct")
    _assert_same_numbers(tokens, logits, *_generate(_reference(per_channel, tmp_path, "dynamic")))
    # and close to the float model (see _PRODUCT_ERROR): 8 quantized products along a token's path
    _, float_tokens, float_logits = _run(base)
    bound = 1.5 * _PRODUCT_ERROR * math.sqrt(summary["num_quantized"])
    for ours, ref in zip(logits, float_logits):
        assert ((ours[0] - ref[0]).norm() / ref[0].norm()).item() <= bound
    assert [t[0] for t in tokens] == [t[0] for t in float_tokens]


@pytest.mark.slow
def test_quantization_fp8_keeps_the_demo_models_answers() -> None:
    """The shipped demo model (trained weights, decisive logits): FP8 answers the questions as float does."""
    from flashvlm.demo.scenes import SPLIT_SEEDS, make_example
    from flashvlm.models.default import default_model_path

    examples = [make_example(SPLIT_SEEDS["test"], 7000 + i) for i in range(16)]
    messages = [[{"role": "user", "content": [{"type": "image", "image": ex.image},
                                               {"type": "text", "text": ex.question}]}] for ex in examples]
    answers = []
    for kw in ({}, {"quantization": "fp8"}):
        llm = LLM(str(default_model_path()), device="cpu", kv_cache_tokens=4096, **kw)
        answers.append([o.text.strip() for o in llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4))])
    assert sum(a == b for a, b in zip(*answers)) >= 15
    assert sum(a == ex.answer for a, ex in zip(answers[1], examples)) >= sum(
        a == ex.answer for a, ex in zip(answers[0], examples)) - 1


# ---- pre-quantized checkpoints ------------------------------------------------------------------------------------
@pytest.mark.parametrize("weight,activation", [("channel", "dynamic"), ("channel", "static"), ("tensor", "static"),
                                               ("channel", None)])
def test_compressed_tensors_checkpoint_matches_reference(base, tmp_path, weight, activation) -> None:
    quantized = write_compressed_tensors_fp8(base, tmp_path / "ct", weight=weight, activation=activation)
    llm, tokens, logits = _run(quantized)
    _assert_same_numbers(tokens, logits, *_generate(_reference(quantized, tmp_path, activation)))
    summary = llm.engine.limits.quantization
    fmt = "float-quantized" if activation else "naive-quantized"
    assert summary["prequantized"] and summary["source"] == f"checkpoint (compressed-tensors, {fmt})"
    assert summary["scheme"]["weight"] == weight and summary["scheme"]["activation"] == activation
    assert summary["num_quantized"] == 8 and summary["float_linear_roots"] == ["lm_head", "visual"]


def test_bfloat16_model(base, tmp_path) -> None:
    """The layer takes and returns the model dtype (bias, output). Against the bfloat16 reference the logits
    differ by bfloat16 rounding (ours accumulates in float32, the reference in bf16), which e4m3 rounding of the
    next layer's inputs amplifies: a 2^-9 difference moves about 1 input in 16 to its neighbouring e4m3 value (a
    2^-4 step), ~1.6% per product and ~5% over 8 (measured 4-5%); a wrong dtype, scale or bias is far beyond."""
    quantized = write_compressed_tensors_fp8(base, tmp_path / "ct", activation="static")
    llm, _, logits = _run(quantized, dtype="bfloat16")
    qkv = llm.engine.model.language_model.layers[0].self_attn.qkv_proj
    assert qkv.bias.dtype == torch.bfloat16 and qkv(torch.randn(3, qkv.in_features).bfloat16()).dtype == torch.bfloat16
    _, ref_logits = _generate(_reference(quantized, tmp_path, "static", dtype="bfloat16"))
    for ours, ref in zip(logits, ref_logits):
        assert ((ours[0] - ref[0]).norm() / ref[0].norm()).item() <= 0.15


def test_compressed_tensors_library_reads_the_same_weights(base, tmp_path) -> None:
    """compressed-tensors' own parsing of the written config and decompression of its tensors give the weights
    our loaded layers hold."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    from flashvlm.quant.fp8_math import dequantize_weight

    quantized = write_compressed_tensors_fp8(base, tmp_path / "ct", weight="channel", activation="dynamic")
    qc = json.loads((quantized / "config.json").read_text())["quantization_config"]
    # sparsity_config, transform_config and version belong to transformers' wrapper of the config
    config = QuantizationConfig.model_validate({k: v for k, v in qc.items()
                                                if k not in ("sparsity_config", "transform_config", "version")})
    scheme = config.config_groups["group_0"]
    state = load_file(str(quantized / "model.safetensors"))
    model = LLM(str(quantized), device="cpu", kv_cache_tokens=1024).engine.model
    attn = model.language_model.layers[1].self_attn.qkv_proj
    ours = dequantize_weight(attn.weight, attn.weight_scale)
    start = 0
    for proj in ("q", "k", "v"):
        prefix = next(n for n in state if n.endswith(f"layers.1.self_attn.{proj}_proj.weight"))[: -len(".weight")]
        theirs = FloatQuantizationCompressor.decompress(
            {"weight": state[f"{prefix}.weight"], "weight_scale": state[f"{prefix}.weight_scale"]}, scheme)["weight"]
        torch.testing.assert_close(ours[start:start + len(theirs)], theirs.float(), rtol=0, atol=0)
        start += len(theirs)
    assert start == attn.out_features


@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
def test_transformers_fp8_block_checkpoint_matches_reference(base, tmp_path, block) -> None:
    quantized = write_transformers_fp8(base, tmp_path / "hf", block=block)
    llm, tokens, logits = _run(quantized)
    _assert_same_numbers(tokens, logits, *_generate(_reference(quantized, tmp_path, "dynamic", group=block[1])))
    summary = llm.engine.limits.quantization
    assert summary["source"] == "checkpoint (fp8)" and tuple(summary["scheme"]["block"]) == block
    assert list(summary["quantized_layers"]) == [
        f"method=fp8, weight=e4m3 per {block[0]}x{block[1]} block, "
        f"activation=e4m3 dynamic per token and {block[1]} columns"]


# ---- refusals ------------------------------------------------------------------------------------------------------
def _with_quant_config(src, dst, quantization_config) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def test_e5m2_weights_are_refused(base, tmp_path) -> None:
    path = write_compressed_tensors_fp8(base, tmp_path / "e5m2", weight_dtype=torch.float8_e5m2)
    with pytest.raises(QuantFormatError, match="float8_e5m2"):
        LLM(str(path), device="cpu", kv_cache_tokens=1024)


def test_group_strategy_is_refused(base, tmp_path) -> None:
    path = write_compressed_tensors_fp8(base, tmp_path / "group",
                                        weight_overrides={"strategy": "group", "group_size": 32})
    with pytest.raises(QuantFormatError, match="'group' strategy"):
        LLM(str(path), device="cpu", kv_cache_tokens=1024)


def test_requantizing_an_fp8_checkpoint_is_refused(base, tmp_path) -> None:
    path = write_compressed_tensors_fp8(base, tmp_path / "ct")
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(path), device="cpu", kv_cache_tokens=1024, quantization="int8")


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_unknown_quant_method_is_refused(base, tmp_path, method) -> None:
    path = _with_quant_config(base, tmp_path / method, {"quant_method": method, "bits": 4, "group_size": 128})
    with pytest.raises(QuantFormatError, match=method):
        LLM(path, device="cpu", kv_cache_tokens=1024)


@pytest.mark.parametrize("qwen25", [False, True])
def test_quantize_vision_rounds_the_tower_too(tmp_path, qwen25) -> None:
    path = build_qwen2_vl(tmp_path / "float", seed=32, qwen25=qwen25)
    llm, tokens, logits = _run(path, quantization="fp8", quantize_vision=True)
    summary = llm.engine.limits.quantization
    model = llm.engine.model
    from flashvlm.quant.fp8_linear import Fp8Linear

    tower = [n for n, m in model.visual.named_modules() if isinstance(m, Fp8Linear)]
    assert len(tower) >= 4 * 2 and summary["quantize_vision"] and summary["num_quantized"] == 8 + len(tower)
    # the patch embedding (a convolution in the checkpoint, fed raw pixels) stays float
    assert model.visual.patch_embed.proj.weight.dtype == torch.float32
    _, float_tokens, float_logits = _run(path)
    bound = 1.5 * _PRODUCT_ERROR * math.sqrt(summary["num_quantized"])
    for ours, ref in zip(logits, float_logits):
        assert ((ours[0] - ref[0]).norm() / ref[0].norm()).item() <= bound
