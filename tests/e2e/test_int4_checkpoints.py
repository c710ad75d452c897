"""INT4 W4A16 end to end: `LLM(..., quantization="int4")` on a float checkpoint, and pre-quantized
compressed-tensors pack-quantized checkpoints (symmetric and asymmetric) through the real loader, whose logits
must equal those of a float model holding the same dequantized weights; formats we cannot run are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.config import ConfigError
from flashvlm.quant.base import QuantFormatError
from flashvlm.quant.int4 import Int4Linear
from flashvlm.testing.quantized_int4 import write_int4_checkpoint
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = {"prompt": IMG + "What is this?", "images": [np.random.default_rng(1).integers(0, 256, (56, 84, 3),
                                                                                         dtype=np.uint8)]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def float_path(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("float"), seed=31, hidden=64)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), device="cpu", kv_cache_tokens=1024, **kw)


def _logits_of(llm: LLM) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and every logits row the engine computed for them."""
    model = llm.engine.model
    rows: list[torch.Tensor] = []
    original = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = original(hidden)
        rows.append(out.detach().float().clone())
        return out

    model.compute_logits = recording
    try:
        tokens = llm.generate(PROMPT, GREEDY)[0].token_ids
    finally:
        model.compute_logits = original
    return tokens, torch.cat(rows)


def test_quantization_int4_on_a_float_checkpoint(float_path, tmp_path) -> None:
    """Rounded at load, the model computes what a float model holding the rounded weights computes."""
    llm = _llm(float_path, quantization="int4")
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 2 * 4  # qkv, o, gate/up, down in each of 2 layers; LM head and vision tower stay float
    assert all(m.group_size == 128 and m.scheme.symmetric for m in layers)
    summary = llm.engine.limits.quantization
    assert summary["method"] == "int4" and not summary["prequantized"] and summary["num_quantized"] == 8
    tokens, logits = _logits_of(llm)
    write_int4_checkpoint(float_path, tmp_path / "unused", 128, True, dequantized_copy=tmp_path / "rounded")
    ref_tokens, ref_logits = _logits_of(_llm(tmp_path / "rounded"))
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    _, float_logits = _logits_of(_llm(float_path))
    assert not torch.allclose(logits, float_logits, atol=1e-3)  # the rounding did happen


def test_random_weights_quantized_for_benchmarks(float_path) -> None:
    llm = _llm(float_path, quantization="int4", load_format="dummy")
    assert llm.engine.limits.quantization["num_quantized"] == 8
    tokens, logits = _logits_of(llm)
    assert len(tokens) == 6 and torch.isfinite(logits).all()


def test_quantize_vision_quantizes_the_tower(float_path) -> None:
    llm = _llm(float_path, quantization="int4", quantize_vision=True, hf_overrides={})
    names = [n for n, m in llm.engine.model.named_modules() if isinstance(m, Int4Linear)]
    assert any(n.startswith("visual.") for n in names)
    assert len(llm.generate(PROMPT, GREEDY)[0].token_ids) == 6


@pytest.mark.parametrize("group_size,symmetric", [(32, True), (32, False), (64, False)])
def test_prequantized_checkpoint_equals_its_dequantized_float_model(float_path, tmp_path, group_size,
                                                                    symmetric) -> None:
    quantized = write_int4_checkpoint(float_path, tmp_path / "w4a16", group_size, symmetric,
                                      dequantized_copy=tmp_path / "dequantized")
    llm = _llm(quantized)
    summary = llm.engine.limits.quantization
    assert summary["prequantized"] and summary["num_quantized"] == 8
    assert summary["scheme"] == {"bits": 4, "group_size": group_size, "symmetric": symmetric}
    tokens, logits = _logits_of(llm)
    ref_tokens, ref_logits = _logits_of(_llm(tmp_path / "dequantized"))
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def test_prequantized_checkpoint_refuses_requantization(float_path, tmp_path) -> None:
    quantized = write_int4_checkpoint(float_path, tmp_path / "w4a16", 32, True)
    with pytest.raises(ConfigError, match="already quantized"):
        _llm(quantized, quantization="fp8")


@pytest.mark.parametrize("overrides,message", [(dict(actorder="group"), "g_idx"),
                                               (dict(num_bits=8), "8-bit weights")])
def test_unsupported_schemes_are_refused_at_load(float_path, tmp_path, overrides, message) -> None:
    quantized = write_int4_checkpoint(float_path, tmp_path / "bad", 32, True, weight_overrides=overrides)
    with pytest.raises(QuantFormatError, match=message):
        _llm(quantized)


def test_llava_prequantized_and_vision_quantized(tmp_path) -> None:
    """The other family: a pre-quantized LLaVA equals its dequantized float model, and --quantize-vision
    rounds its CLIP tower and projector (the patch embedding, a conv, stays float)."""
    from flashvlm.testing.tiny_checkpoints import build_llava

    path = build_llava(tmp_path / "llava")
    prompt = {"prompt": "USER: <image>\nWhat is this? ASSISTANT:",
              "images": [np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)]}
    quantized = write_int4_checkpoint(path, tmp_path / "q", 32, False, dequantized_copy=tmp_path / "dq")
    answers = [_llm(p).generate(prompt, GREEDY)[0].token_ids for p in (quantized, tmp_path / "dq")]
    assert answers[0] == answers[1]
    llm = _llm(path, quantization="int4", quantize_vision=True)
    names = [n for n, m in llm.engine.model.named_modules() if isinstance(m, Int4Linear)]
    assert any(n.startswith("vision_tower.") for n in names) and any("projector" in n for n in names)
    assert len(llm.generate(prompt, GREEDY)[0].token_ids) == 6
