"""Fuyu parts against transformers on a tiny random checkpoint: the Persimmon pieces in layers/ (partial rotary,
QK-norm, relu^2), the patch projection with its newline rows, both checkpoint layouts, the load checks, the
image processor's config checks, and the requests this family refuses (several images, pruning, misplaced
placeholders)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from flashvlm import LLM, SamplingParams
from flashvlm.config import ConfigError
from flashvlm.layers.activation import get_activation
from flashvlm.layers.norm import HeadLayerNorm
from flashvlm.layers.rotary import RotaryEmbedding, apply_partial_rotary
from flashvlm.models.persimmon import deinterleave_qkv
from flashvlm.processing.fuyu_image import FuyuImageProcessor
from flashvlm.request import InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_fuyu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_fuyu(tmp_path_factory.mktemp("fuyu"), seed=11)


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_tokens=1024)


def _image(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_partial_rotary_matches_persimmon() -> None:
    from transformers.models.persimmon.modeling_persimmon import apply_rotary_pos_emb

    head_dim, rotary = 16, 8
    x = torch.randn(5, 3, head_dim, generator=torch.Generator().manual_seed(0))
    cos, sin = RotaryEmbedding(rotary, {"rope_theta": 25000.0})(torch.arange(5) * 7, torch.float32)
    ours = apply_partial_rotary(x, cos, sin)
    hx = x.transpose(0, 1)[None]  # (batch, heads, tokens, dim)
    rot, _ = apply_rotary_pos_emb(hx[..., :rotary], hx[..., :rotary], cos[None], sin[None])
    want = torch.cat((rot, hx[..., rotary:]), dim=-1)[0].transpose(0, 1)
    torch.testing.assert_close(ours, want, rtol=0, atol=0)
    assert torch.equal(ours[..., rotary:], x[..., rotary:])


def test_head_layer_norm_and_relu_squared() -> None:
    g = torch.Generator().manual_seed(1)
    norm = HeadLayerNorm(8, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=g))
        norm.bias.copy_(torch.randn(8, generator=g))
    x = torch.randn(4, 3 * 8, generator=g)
    want = torch.nn.functional.layer_norm(x.view(4, 3, 8), (8,), norm.weight, norm.bias, 1e-5).reshape(4, -1)
    torch.testing.assert_close(norm(x), want, rtol=0, atol=0)
    torch.testing.assert_close(get_activation("relu2")(x), transformers.activations.ACT2FN["relu2"](x))


def test_deinterleave_qkv_splits_per_head_rows() -> None:
    heads, dim = 2, 3
    rows = torch.arange(heads * 3 * dim)  # (head, q|k|v, channel)
    out = deinterleave_qkv(rows, heads).view(3, heads, dim)
    assert out[0, 1].tolist() == [9, 10, 11] and out[1, 0].tolist() == [3, 4, 5] and out[2, 1].tolist() == [15, 16, 17]


def test_every_per_row_qkv_tensor_is_reordered(llm: LLM) -> None:
    model = llm.engine.model
    rows = 3 * model.config.text_config.hidden_size
    name = "model.language_model.layers.0.self_attn.query_key_value."
    scale, per_tensor = torch.arange(rows, dtype=torch.float32)[:, None], torch.ones(1)
    out = dict(model._prepare([(name + "weight_scale", scale), (name + "input_scale", per_tensor)]))
    assert torch.equal(out[name + "weight_scale"], deinterleave_qkv(scale, 4))
    assert out[name + "input_scale"] is per_tensor
    with pytest.raises(ValueError, match="interleaved"):
        list(model._prepare([(name + "weight_zero_point", torch.zeros(rows // 8, 2))]))


def test_encoded_image_is_patch_projection_with_newline_rows(llm: LLM, ckpt: Path) -> None:
    hf = transformers.FuyuForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    item = llm.engine.process_prompt({"prompt": "Hi", "images": [_image(70, 50)]}).mm_items[0]
    rows, cols = item.layout
    assert (rows, cols) == (2, 3) and item.num_tokens == rows * (cols + 1)
    (emb,) = llm.engine.model.encode_images([item])
    with torch.no_grad():
        patches = hf.model.vision_embed_tokens(item.model_pixels())
        newline = hf.get_input_embeddings().weight[llm.engine.model.image_newline_token_id]
    grid = emb.view(rows, cols + 1, -1)
    torch.testing.assert_close(grid[:, :cols].reshape(rows * cols, -1), patches, rtol=0, atol=1e-6)
    assert torch.equal(grid[:, cols], newline.expand(rows, -1))


def test_the_hub_layout_loads_the_same(llm: LLM, tmp_path: Path) -> None:
    """adept/fuyu-8b names its tensors language_model.model.*, language_model.lm_head.*, vision_embed_tokens.*"""
    legacy = build_fuyu(tmp_path / "hub", seed=11, legacy_layout=True)
    from safetensors import safe_open

    with safe_open(str(legacy / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118 - safe_open is not a dict
    assert {"vision_embed_tokens.weight", "language_model.lm_head.weight"} <= names
    other = LLM(str(legacy), device="cpu", dtype="float32", kv_cache_tokens=1024)
    prompt = {"prompt": "Describe.", "images": [_image(64, 90, seed=3)]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert other.generate([prompt], params)[0].token_ids == llm.generate([prompt], params)[0].token_ids
    for a, b in zip(other.engine.model.state_dict().values(), llm.engine.model.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("size", [(40, 40), (30, 30)], ids=["2x2", "1x1"])
def test_token_id_prompts_take_one_placeholder_or_the_whole_expansion(llm: LLM, size: tuple[int, int]) -> None:
    image = _image(*size)
    text = llm.engine.process_prompt({"prompt": "What?", "images": [image]})
    item = text.mm_items[0]
    one = llm.engine.process_prompt({"prompt_token_ids": [llm.engine.model.image_token_id] +
                                     text.prompt_token_ids[item.end:], "images": [image]})
    assert one.prompt_token_ids == text.prompt_token_ids and one.mm_items[0].offset == 0
    expanded = llm.engine.process_prompt({"prompt_token_ids": text.prompt_token_ids, "images": [image]})
    assert expanded.prompt_token_ids == text.prompt_token_ids and expanded.mm_items[0].offset == 0
    with pytest.raises(InvalidRequestError, match="placeholder"):  # a row cut short is neither
        llm.engine.process_prompt({"prompt_token_ids": text.prompt_token_ids[1:], "images": [image]})


@pytest.mark.parametrize(("prompt", "needle"), [
    ({"prompt": "Two: ", "images": [_image(30, 30), _image(40, 40)]}, "at most 1"),
    ({"prompt": "Look |SPEAKER| here", "images": [_image(30, 30)]}, "may only open the prompt"),
    ({"prompt": "hi", "images": [_image(30, 30)], "mm_processor_kwargs": {"max_pixels": 10}}, "mm_processor_kwargs"),
    ({"prompt": "hi", "images": [_image(30, 30)], "mm_processor_kwargs": {"mm_token_pruning": "pool"}}, "no grid"),
])
def test_refused_requests_are_clear_and_the_engine_serves_on(llm: LLM, prompt: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        llm.generate([prompt], SamplingParams(max_tokens=2))
    out = llm.generate([{"prompt": "hi", "images": [_image(30, 30)]}], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2


def test_engine_wide_pruning_is_refused(ckpt: Path) -> None:
    with pytest.raises(ConfigError, match="no grid"):
        LLM(str(ckpt), device="cpu", kv_cache_tokens=1024, mm_token_pruning="pool", mm_token_keep_ratio=0.5)


def _rewrite(src: Path, dst: Path, name: str, change) -> Path:
    import shutil

    shutil.copytree(src, dst)
    data = json.loads((dst / name).read_text())
    change(data)
    (dst / name).write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize(("name", "change", "needle"), [
    ("config.json", lambda d: d.update(image_token_id=5), "image_token_id"),
    ("config.json", lambda d: d.update(patch_size=14), "patches"),
    ("preprocessor_config.json", lambda d: d.update(size={"height": 100, "width": 240}), "whole number"),
    ("preprocessor_config.json", lambda d: d.update(padding_mode="reflect"), "padding_mode"),
])
def test_checkpoints_that_do_not_fit_are_refused(ckpt: Path, tmp_path: Path, name: str, change, needle: str) -> None:
    bad = _rewrite(ckpt, tmp_path / "bad", name, change)
    with pytest.raises(ConfigError, match=needle):
        LLM(str(bad), device="cpu", kv_cache_tokens=1024)


def test_processor_fits_the_canvas_and_pads_to_whole_patches() -> None:
    proc = FuyuImageProcessor.from_config({"size": {"height": 1080, "width": 1920}})
    assert (proc.image_mean, proc.image_std, proc.resample) == ((0.5,) * 3, (0.5,) * 3, 2)
    assert proc.grid(756, 1008) == (26, 34)  # kept: 756 / 30 and 1008 / 30 round up
    assert proc.resized_hw(2160, 1000) == (1080, 500) and proc.grid(2160, 1000) == (36, 17)
    assert proc.max_grid() == (36, 64) and proc.num_image_tokens((36, 64)) == 36 * 65
    compact, grid = proc.preprocess_compact(Image.fromarray(_image(31, 29)))
    assert grid == (1, 2) and compact.shape == (30, 60, 3)
    assert (compact[29:] == 1).all() and (compact[:, 31:] == 1).all()  # padding_value 1.0 on the 0..255 scale
    no_pad = FuyuImageProcessor.from_config({"do_pad": False})
    with pytest.raises(InvalidRequestError, match="does not pad"):
        no_pad.grid(29, 31)
