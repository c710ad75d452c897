"""Checkpoint folder variants load through the real loader and give the same answers; the CLI works."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.cli import main
from flashvlm.config import ConfigError, ModelConfig
from flashvlm.models.loader import read_checkpoint
from flashvlm.testing.tiny_checkpoints import build_llava, build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = {"prompt": IMG + "What is this?", "images": [np.random.default_rng(0).integers(0, 256, (56, 84, 3),
                                                                                         dtype=np.uint8)]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _answer(path, **kw) -> list[int]:
    return LLM(str(path), device="cpu", kv_cache_tokens=1024, **kw).generate(PROMPT, GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = build_qwen2_vl(tmp_path_factory.mktemp("ref"), seed=21)
    return path, _answer(path)


@pytest.mark.parametrize("variant", [dict(legacy_layout=True), dict(legacy_layout=False),
                                     dict(shard_size="100KB")])
def test_layouts_and_shards_agree(reference, tmp_path, variant) -> None:
    ref_path, ref_tokens = reference
    path = build_qwen2_vl(tmp_path / "v", seed=21, **variant)
    if "shard_size" in variant:
        assert (path / "model.safetensors.index.json").exists()
    assert _answer(path) == ref_tokens


def test_tied_embeddings_load(tmp_path) -> None:
    path = build_qwen2_vl(tmp_path / "tied", seed=22, tie_word_embeddings=True, legacy_layout=True)
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024)
    assert llm.engine.model.lm_head is None
    assert len(llm.generate(PROMPT, GREEDY)[0].token_ids) == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoint(tmp_path, dtype) -> None:
    path = build_qwen2_vl(tmp_path / "half", seed=23, dtype=dtype)
    llm = LLM(str(path), device="cpu", dtype="auto", kv_cache_tokens=1024)
    assert llm.engine.dtype == torch.float32  # CPU computes in float32 whatever the checkpoint holds
    assert len(llm.generate(PROMPT, GREEDY)[0].token_ids) == 8
    half = LLM(str(path), device="cpu", dtype="bfloat16", kv_cache_tokens=1024)
    assert next(half.engine.model.parameters()).dtype == torch.bfloat16
    assert len(half.generate(PROMPT, GREEDY)[0].token_ids) == 8


def test_chat_template_sources(reference, tmp_path) -> None:
    ref_path, _ = reference
    template = (ref_path / "chat_template.jinja").read_text()
    as_json = tmp_path / "json"
    shutil.copytree(ref_path, as_json)
    (as_json / "chat_template.jinja").unlink()
    (as_json / "chat_template.json").write_text(json.dumps({"chat_template": template + "{# json #}"}))
    assert read_checkpoint(ModelConfig(str(as_json))).chat_template.endswith("{# json #}")
    in_tokenizer = tmp_path / "tok"
    shutil.copytree(ref_path, in_tokenizer)
    (in_tokenizer / "chat_template.jinja").unlink()
    tok_cfg = json.loads((in_tokenizer / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = template + "{# tokcfg #}"
    (in_tokenizer / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    assert read_checkpoint(ModelConfig(str(in_tokenizer))).chat_template.endswith("{# tokcfg #}")


@pytest.fixture(scope="module")
def llava_path(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("llava"), seed=24)


def _llava_copy(llava_path, tmp_path, preprocessor: dict | None):
    """The tiny LLaVA with its preprocessor_config.json replaced (None: removed)."""
    path = tmp_path / "llava"
    shutil.copytree(llava_path, path)
    (path / "preprocessor_config.json").unlink()
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return path


def test_image_processor_settings_from_processor_config(llava_path, tmp_path) -> None:
    """transformers 5's processor save keeps the image processor inside processor_config.json only."""
    from transformers import AutoTokenizer, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    settings = json.loads((llava_path / "preprocessor_config.json").read_text())
    path = _llava_copy(llava_path, tmp_path, None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    image_processor = CLIPImageProcessorPil(**{k: v for k, v in settings.items()
                                               if k not in ("image_processor_type", "processor_class")})
    LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                   vision_feature_select_strategy="default").save_pretrained(path)
    assert not (path / "preprocessor_config.json").exists()
    assert read_checkpoint(ModelConfig(str(path))).preprocessor_config["crop_size"] == {"height": 56, "width": 56}
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024)
    out = llm.generate({"prompt": "<image>\nhi", "images": [PROMPT["images"][0]]}, GREEDY)[0]
    assert len(out.token_ids) == 8


def test_missing_image_processor_settings_warn(reference, tmp_path, caplog) -> None:
    ref_path, _ = reference
    path = tmp_path / "qwen"
    shutil.copytree(ref_path, path)
    (path / "preprocessor_config.json").unlink()
    with caplog.at_level(logging.WARNING, logger="flashvlm.models.loader"):
        assert read_checkpoint(ModelConfig(str(path))).preprocessor_config == {}
    assert "neither preprocessor_config.json nor" in caplog.text


@pytest.mark.parametrize("preprocessor", [None, {"crop_size": {"height": 112, "width": 112},
                                                 "size": {"shortest_edge": 112}},
                                          {"crop_size": {"height": 57, "width": 57}, "size": {"shortest_edge": 57}},
                                          {"do_center_crop": False, "size": {"shortest_edge": 56}}])
def test_clip_crop_must_fit_the_vision_tower(llava_path, tmp_path, preprocessor) -> None:
    # Without settings the CLIP default crop is 224; 57 gives the same 16 tokens but not the tower's input shape;
    # without a crop the token count would depend on each image.
    path = _llava_copy(llava_path, tmp_path, preprocessor)
    with pytest.raises(ConfigError, match="image_size|does not fit"):
        read_checkpoint(ModelConfig(str(path)))


def _rewrite_weights(path, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(path / "model.safetensors"))
    save_file(edit(state), str(path / "model.safetensors"), metadata={"format": "pt"})


def test_unused_checkpoint_tensors_are_reported(reference, tmp_path, caplog) -> None:
    path = build_qwen2_vl(tmp_path / "extra", seed=21, legacy_layout=True)
    extra = {f"model.mystery.{i}.weight": torch.zeros(2) for i in range(7)}
    harmless = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(4),
                "visual.blocks.0.attn.rotary.inv_freq": torch.zeros(4)}
    _rewrite_weights(path, lambda state: {**state, **extra, **harmless})
    with caplog.at_level(logging.WARNING, logger="flashvlm.models.weight_utils"):
        assert _answer(path) == reference[1]
    warnings = [r.getMessage() for r in caplog.records if r.name == "flashvlm.models.weight_utils"]
    assert len(warnings) == 1
    assert warnings[0].startswith("7 checkpoint tensor(s)") and "model.mystery.0.weight" in warnings[0]
    assert "inv_freq" not in warnings[0]


def test_clean_checkpoints_load_without_warnings(reference, llava_path, tmp_path, caplog) -> None:
    # Tied heads and the CLIP layers after the feature layer are skipped on purpose: no warning for those.
    tied = build_qwen2_vl(tmp_path / "tied", seed=22, tie_word_embeddings=True)
    with caplog.at_level(logging.WARNING, logger="flashvlm.models.weight_utils"):
        for path in (reference[0], llava_path, tied):
            LLM(str(path), device="cpu", kv_cache_tokens=1024)
    assert not [r for r in caplog.records if r.name == "flashvlm.models.weight_utils"]


def test_duplicate_tensors_across_files_are_refused(reference, tmp_path) -> None:
    path = build_qwen2_vl(tmp_path / "dup", seed=21, legacy_layout=True)
    shutil.copy(path / "model.safetensors", path / "consolidated.safetensors")
    with pytest.raises(ConfigError, match="in both consolidated.safetensors and model.safetensors"):
        LLM(str(path), device="cpu", kv_cache_tokens=1024)


def test_dummy_weights_are_seeded(reference) -> None:
    ref_path, _ = reference
    a = _answer(ref_path, load_format="dummy", seed=7)
    b = _answer(ref_path, load_format="dummy", seed=7)
    c = LLM(str(ref_path), device="cpu", kv_cache_tokens=1024, load_format="dummy", seed=8)
    assert a == b
    first = next(iter(c.engine.model.parameters()))
    d = LLM(str(ref_path), device="cpu", kv_cache_tokens=1024, load_format="dummy", seed=7)
    assert not torch.equal(first, next(iter(d.engine.model.parameters())))


def test_cli_generate_default_model(tmp_path, capsys) -> None:
    """Without --model the embedded demo model answers a question about a scene it has never seen."""
    from flashvlm.demo.scenes import SPLIT_SEEDS, make_example

    ex = make_example(SPLIT_SEEDS["test"], 5003)  # the picture of examples/number.png
    img = tmp_path / "x.png"
    ex.image.save(img)
    assert ex.question == "What number is written in the box?"
    assert main(["generate", "--image", str(img), "--device", "cpu", ex.question]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == ex.answer and "finish=stop" in out.err and "demo model" in out.err
    # a bad image is a clear error and exit code 1, not a traceback
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    assert main(["generate", "--image", str(bad), "hi"]) == 1
    assert "image 0" in capsys.readouterr().err


def test_cli_help(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--model", "--image", "--max-tokens", "--temperature", "--device", "--dtype"):
        assert flag in text
