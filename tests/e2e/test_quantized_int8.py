"""INT8 W8A8 end to end: `--quantization int8` on a float checkpoint, and compressed-tensors int-quantized
checkpoints (written by flashvlm/testing/quantized_int8.py) through the real loader, against transformers running
the same tensors dequantized with the activations quantize-dequantized per the scheme, and against
compressed-tensors' own decompression when it is installed."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.config import ConfigError
from flashvlm.quant.base import QuantFormatError
from flashvlm.quant.int8 import Int8Linear
from flashvlm.testing.quantized_int8 import STATIC_INPUT_SCALES, build_int8_qwen2_vl
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [{"prompt": IMG + "What is this?",
            "images": [np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)]},
           {"prompt": "How many triangles are in the picture?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
_PROJ = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$")


def _run(path, **kw) -> tuple[LLM, list[list[int]], list[torch.Tensor]]:
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024, **kw)
    llm.engine.runner.record_logits = True
    outs = llm.generate(PROMPTS, GREEDY)
    return llm, [o.token_ids for o in outs], [llm.engine.runner.recorded_logits[o.request_id][0] for o in outs]


def test_quantization_int8_from_float_checkpoint(tmp_path):
    """RTN int8 of the language model's projections stays close to the float model. The bound: each of the 8
    products carries the rounding of its weights and activations to steps of amax / 127 (relative rms error
    ~0.7% each for rows of 64-128 Gaussian values, ~1% together); the residual stream adds them up to a few
    percent of the hidden state, and the largest of 512 logit errors is ~3.5 times their rms, so ~0.1 of the
    logits' spread (measured here: 0.065 and 0.089). 0.2 leaves twice that. The first greedy token must agree:
    the float model's top-two margins (0.09, 0.18) are twice the measured logit error."""
    path = build_qwen2_vl(tmp_path / "float", seed=5)
    _, float_tokens, float_logits = _run(path)
    llm, tokens, logits = _run(path, quantization="int8")
    summary = llm.engine.limits.quantization
    assert summary["method"] == "int8" and not summary["prequantized"]
    assert summary["num_quantized"] == 8  # 2 layers x (qkv, o, gate_up, down)
    assert summary["float_linear_roots"] == ["lm_head", "visual"]
    for ours, ref in zip(logits, float_logits):
        assert 0 < (ours - ref).abs().max() <= 0.2 * ref.std()
    assert [t[0] for t in tokens] == [t[0] for t in float_tokens]


def _fake_quant(x: torch.Tensor, scale: float | None) -> torch.Tensor:
    s = x.abs().amax(dim=-1, keepdim=True) / 127 if scale is None else torch.tensor(scale, dtype=x.dtype)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp(-127, 127) * s


def _transformers_reference(path, tmp_path, static: bool):
    """transformers' Qwen2-VL on the checkpoint's tensors dequantized (weight * weight_scale), each quantized
    projection's input quantize-dequantized: per token, or with its static scale (q/k/v and gate/up read one input,
    which takes the largest of their scales)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2VLForConditionalGeneration

    state = load_file(str(path / "model.safetensors"))
    floats = {}
    for name, t in state.items():
        if name.endswith((".weight_scale", ".input_scale")):
            continue
        scale = state.get(name[: -len("weight")] + "weight_scale") if name.endswith(".weight") else None
        floats[name] = t.float() * scale.float() if scale is not None else t
    ref = tmp_path / "dequantized"
    shutil.copytree(path, ref)
    save_file(floats, str(ref / "model.safetensors"))
    config = json.loads((ref / "config.json").read_text())
    del config["quantization_config"]
    (ref / "config.json").write_text(json.dumps(config))
    model = Qwen2VLForConditionalGeneration.from_pretrained(str(ref), dtype=torch.float32).eval()
    groups = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
    group_scale: dict[str, float] = {}
    for proj, s in STATIC_INPUT_SCALES.items():
        key = groups.get(proj, proj)
        group_scale[key] = max(group_scale.get(key, 0.0), s)
    hooked = 0
    for name, module in model.named_modules():
        hit = _PROJ.search(name)
        if hit and "visual" not in name:
            scale = group_scale[groups.get(hit.group(2), hit.group(2))] if static else None
            module.register_forward_pre_hook(lambda m, args, scale=scale: (_fake_quant(args[0], scale),))
            hooked += 1
    assert hooked == 14  # 2 layers x 7 projections
    return model


def _transformers_logits(model, llm: LLM, prompt: dict) -> torch.Tensor:
    processed = llm.engine.process_prompt(prompt)
    ids = torch.tensor([processed.prompt_token_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if processed.mm_items:
        inputs["pixel_values"] = torch.cat([it.model_pixels() for it in processed.mm_items])
        inputs["image_grid_thw"] = torch.tensor([it.layout for it in processed.mm_items])
        inputs["mm_token_type_ids"] = (ids == llm.engine.model.image_token_id).long()
    with torch.inference_mode():
        return model(**inputs).logits[0, -1]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_int_quantized_checkpoint_matches_its_reference(tmp_path, static):
    """Our integer products are exact and transformers' float32 products of the same numbers round at ~1e-7, so
    the two agree to float32 noise (measured: under 1e-6), unless that noise moves an activation across a
    rounding tie of the next layer's quantization (one step of amax / 127 in one element); 1e-3 on logits of
    spread ~0.7 covers a few such flips and fails for a real misreading: without the activations' quantization
    in the reference the logits differ by 2e-2 to 5e-2, and a wrong scale or misplaced shard moves them more."""
    path = build_int8_qwen2_vl(tmp_path / "w8a8", seed=7, static_activations=static)
    llm, tokens, logits = _run(path)
    summary = llm.engine.limits.quantization
    assert summary["prequantized"] and summary["source"] == "checkpoint (compressed-tensors, int-quantized)"
    assert summary["scheme"] == {"static_activations": static} and summary["num_quantized"] == 8
    assert summary["float_linear_roots"] == ["lm_head", "visual"]
    reference = _transformers_reference(path, tmp_path, static)
    for prompt, ours in zip(PROMPTS, logits):
        expected = _transformers_logits(reference, llm, prompt)
        assert (ours - expected).abs().max() <= 1e-3
    assert all(len(t) == GREEDY.max_tokens for t in tokens)


def test_layers_agree_with_compressed_tensors_decompression(tmp_path):
    """compressed-tensors validates the config we write, quantizes the float weights to the integers the
    checkpoint holds, and dequantizes them to what our loaded layers hold, rows of merged projections included."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from safetensors.torch import load_file

    del ct
    float_path = build_qwen2_vl(tmp_path / "float", seed=9)
    path = build_int8_qwen2_vl(tmp_path / "w8a8", seed=9)
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    args = QuantizationArgs.model_validate(config["config_groups"]["group_0"]["weights"])
    assert parsed.format == "int-quantized" and parsed.config_groups["group_0"].input_activations.dynamic
    state, float_state = load_file(str(path / "model.safetensors")), load_file(str(float_path / "model.safetensors"))
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024)
    layers = llm.engine.model.language_model.layers
    merged = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
              "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
              "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
              "down_proj": ("mlp.down_proj", 0)}
    checked = 0
    for name, q in state.items():
        hit = _PROJ.search(name[: -len(".weight")]) if name.endswith(".weight") else None
        if hit is None or "visual" in name:
            continue
        scale = state[name + "_scale"]
        theirs_q = quantize(float_state[name], scale, None, args, dtype=torch.int8)
        assert torch.equal(theirs_q, q)
        layer = layers[int(hit.group(1))].get_submodule(merged[hit.group(2)][0])
        assert isinstance(layer, Int8Linear)
        shard = merged[hit.group(2)][1]
        start = sum(layer.out_sizes[:shard])
        ours = layer.dequantized_weight()[start : start + q.shape[0]]
        torch.testing.assert_close(ours, dequantize(q, scale, None, args).float(), rtol=0, atol=0)
        checked += 1
    assert checked == 14


def _with_config(path, edit) -> None:
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    edit(config["quantization_config"])
    config_file.write_text(json.dumps(config))


def test_load_refusals(tmp_path):
    path = build_int8_qwen2_vl(tmp_path / "w8a8", seed=11)
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(path), device="cpu", kv_cache_tokens=1024, quantization="int4")
    _with_config(path, lambda qc: qc["config_groups"]["group_0"]["weights"].update(symmetric=False))
    with pytest.raises(QuantFormatError, match="asymmetric weights"):
        LLM(str(path), device="cpu", kv_cache_tokens=1024)
    _with_config(path, lambda qc: qc["config_groups"]["group_0"].update(
        input_activations=None, weights={**qc["config_groups"]["group_0"]["weights"], "symmetric": True}))
    with pytest.raises(QuantFormatError, match="W8A16"):
        LLM(str(path), device="cpu", kv_cache_tokens=1024)
