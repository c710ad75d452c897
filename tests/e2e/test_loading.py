"""Checkpoint folder variants load through the real loader and give the same answers; the CLI works."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.cli import main
from flashvlm.config import ModelConfig
from flashvlm.models.loader import read_checkpoint
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

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
