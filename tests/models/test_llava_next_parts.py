"""LLaVA-NeXT parts against transformers: the any-resolution geometry and token counts (HF's processor), pixel values
(HF's PIL-backend image processor, the real 336-pixel config too), image features (HF's model), both checkpoint
layouts, the load checks, and bad images."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from flashvlm import LLM
from flashvlm.config import ConfigError
from flashvlm.models.llava_next import LlavaNextForConditionalGeneration
from flashvlm.models.weight_utils import check_all_loaded, iterate_checkpoint
from flashvlm.processing.anyres import best_resolution, largest_layout
from flashvlm.processing.llava_next_image import DEFAULT_PINPOINTS, LlavaNextImageProcessor
from flashvlm.request import InvalidRequestError
from flashvlm.testing.checkpoint_writer import CLIP_MEAN, CLIP_STD, build_tokenizer
from flashvlm.testing.tiny_llava import LLAVA_SPECIAL_TOKENS
from flashvlm.testing.tiny_llava_next import build_llava_next, tiny_pinpoints

# (width, height): square, wide, tall, extreme both ways, odd sizes, larger than every pinpoint
SIZES = [(56, 56), (112, 56), (56, 168), (300, 200), (77, 301), (500, 20), (20, 500), (1008, 756), (333, 334),
         (4000, 3000), (13, 17)]


def _config(tile: int) -> dict:
    return {"size": {"shortest_edge": tile}, "crop_size": {"height": tile, "width": tile}, "resample": 3,
            "image_grid_pinpoints": tiny_pinpoints(tile), "do_center_crop": True, "do_pad": True,
            "image_mean": CLIP_MEAN, "image_std": CLIP_STD}


def _image(size: tuple[int, int], seed: int = 0) -> np.ndarray:
    width, height = size
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava_next(tmp_path_factory.mktemp("llava_next"), seed=11)


@pytest.mark.parametrize("tile", [56, 336])
def test_token_counts_and_tiles_match_hf(tile: int) -> None:
    """HF's processor counts the placeholders of each picture (its own formula, from the processed tile size); our
    layout gives the same count, and the tile grid of HF's best resolution."""
    from transformers import LlavaNextProcessor
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = build_tokenizer(LLAVA_SPECIAL_TOKENS, 300, "", eos="</s>", bos="<s>", pad="<pad>")
    hf = LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil(**_config(tile)), tokenizer=tokenizer,
                            patch_size=14, vision_feature_select_strategy="default", num_additional_image_tokens=1)
    ours = LlavaNextImageProcessor.from_config(_config(tile))
    rng = np.random.default_rng(tile)
    sizes = SIZES + [tuple(int(x) for x in rng.integers(1, 1500, 2)) for _ in range(300)]
    for width, height in sizes:
        layout = ours.layout(height, width, tile // 14)
        assert layout.num_tokens == hf._get_number_of_features(height, width, tile, tile) - 1, (width, height)
        best = select_best_resolution((height, width), [list(p) for p in ours.pinpoints])
        assert best_resolution(height, width, ours.pinpoints) == tuple(best)
        assert (layout.rows, layout.cols) == (best[0] // tile, best[1] // tile)


@pytest.mark.parametrize("tile", [56, 336])
def test_pixels_match_hf(tile: int) -> None:
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    hf = LlavaNextImageProcessorPil(**_config(tile))
    ours = LlavaNextImageProcessor.from_config(_config(tile))
    for seed, size in enumerate(SIZES[:9]):
        picture = Image.fromarray(_image(size, seed))
        want = hf(images=[picture], return_tensors="pt")["pixel_values"][0]
        got = ours.preprocess(picture)
        assert got.shape == want.shape, size
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_defaults_are_the_released_checkpoints_tiles() -> None:
    proc = LlavaNextImageProcessor.from_config({})
    assert proc.pinpoints == DEFAULT_PINPOINTS and proc.tile == 336 and proc.tile_hw() == (336, 336)


def test_image_features_match_hf(ckpt: Path) -> None:
    """Our tower, projector, stitching, unpadding and newlines against HF's get_image_features, several aspects in
    one batch."""
    hf = transformers.LlavaNextForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    config = transformers.AutoConfig.from_pretrained(ckpt)
    model = LlavaNextForConditionalGeneration(config).eval()
    check_all_loaded(model, model.load_weights(iterate_checkpoint(ckpt)))
    llm = LLM(str(ckpt), device="cpu", dtype="float32", kv_cache_tokens=1024)
    items = [llm.engine.process_prompt({"prompt": "<image>", "images": [_image(s, i)]}).mm_items[0]
             for i, s in enumerate([(56, 112), (300, 200), (500, 20), (77, 301)])]
    inputs = llm.engine.checkpoint.family.baseline_image_inputs(items, None, None, model.image_token_id, "cpu")
    with torch.inference_mode():
        want = hf.model.get_image_features(**inputs).pooler_output
        got = model.encode_images(items)
    assert [g.shape[0] for g in got] == [it.num_tokens for it in items] == [w.shape[0] for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert len({it.num_tokens for it in items}) == len(items)  # the aspects really give different counts


def test_hub_layout_loads_the_same_model(ckpt: Path, tmp_path: Path) -> None:
    """llava-hf's hub files name tensors language_model.model.*, vision_tower.*, image_newline: the same weights."""
    legacy = build_llava_next(tmp_path / "legacy", seed=11, legacy_layout=True)
    from safetensors import safe_open

    with safe_open(str(legacy / "model.safetensors"), "pt") as f:
        names = list(f.keys())  # noqa: SIM118 (a safetensors handle is no dict)
    assert "image_newline" in names and any(k.startswith("language_model.model.") for k in names)
    config = transformers.AutoConfig.from_pretrained(ckpt)
    a, b = LlavaNextForConditionalGeneration(config), LlavaNextForConditionalGeneration(config)
    check_all_loaded(a, a.load_weights(iterate_checkpoint(ckpt)))
    check_all_loaded(b, b.load_weights(iterate_checkpoint(legacy)))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert a.image_newline.abs().sum() > 0


def _edit(path: Path, name: str, **changes) -> None:
    data = json.loads((path / name).read_text())
    data.update(changes)
    (path / name).write_text(json.dumps(data))


@pytest.mark.parametrize("change", ["pinpoints", "crop", "strategy"])
def test_checkpoints_whose_parts_do_not_fit_are_refused(tmp_path: Path, change: str) -> None:
    path = build_llava_next(tmp_path, seed=1)
    if change == "pinpoints":
        _edit(path, "preprocessor_config.json", image_grid_pinpoints=[[56, 112], [112, 56]])
        match = "image_grid_pinpoints differ"
    elif change == "crop":
        _edit(path, "preprocessor_config.json", size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112},
              image_grid_pinpoints=[[112, 224]])
        match = "vision tower takes 56x56"
    else:
        _edit(path, "config.json", vision_feature_select_strategy="full")
        match = "'default'"
    with pytest.raises((ConfigError, ValueError), match=match):
        LLM(str(path), device="cpu", kv_cache_tokens=512)


def test_sliding_window_text_models_are_refused(ckpt: Path) -> None:
    config = copy.deepcopy(transformers.AutoConfig.from_pretrained(ckpt))
    config.text_config.sliding_window = 64
    with pytest.raises(ValueError, match="sliding-window"):
        LlavaNextForConditionalGeneration(config)


def test_bad_images_are_refused_per_request(ckpt: Path) -> None:
    llm = LLM(str(ckpt), device="cpu", kv_cache_tokens=1024)
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        llm.engine.process_prompt({"prompt": "<image>", "images": [_image((1, 400))]})
    with pytest.raises(InvalidRequestError, match="mm_processor_kwargs"):
        llm.engine.process_prompt({"prompt": "<image>", "images": [_image((56, 56))],
                                   "mm_processor_kwargs": {"max_pixels": 10}})
    assert len(llm.engine.process_prompt({"prompt": "<image>", "images": [_image((56, 56))]}).mm_items) == 1


def test_memory_profile_item_is_the_heaviest_image(ckpt: Path) -> None:
    llm = LLM(str(ckpt), device="cpu", kv_cache_tokens=1024)
    inputs = llm.engine.input_processor.image_inputs
    profile = inputs.profile_item()
    assert profile.pixel_values.shape == (1 + profile.layout.num_crops, 3, 56, 56)
    proc = inputs.processor
    rng = np.random.default_rng(0)
    for width, height in SIZES + [tuple(int(x) for x in rng.integers(1, 2000, 2)) for _ in range(200)]:
        layout = proc.layout(height, width, inputs.side)
        assert layout.num_tokens <= profile.num_tokens and layout.num_crops <= profile.layout.num_crops
    assert profile.layout == largest_layout(proc.pinpoints, proc.tile, inputs.side)
