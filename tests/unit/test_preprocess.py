"""Preprocessing parity with the HF transformers image processors (PIL backend, built in code).

Tolerance: the acceptance bound is a pixel max abs diff <= 1e-2 on the normalized values. One uint8
step after normalization is 1/255/std >= 0.0142 (largest CLIP std 0.2758), so 1e-2 admits only
float rounding differences (operation order, fused rescale*normalize, an ulp of a GPU division)
and never a different resampled pixel: grid, token count and every resized uint8 value must agree.
On CPU we follow HF's exact sequence (Pillow resize on uint8, rescale in float64 -> float32,
normalize in float32), and the observed difference is 0.0; ``test_cpu_path_is_bit_exact`` pins it.

The HF torchvision ("fast") processors need torchvision, which is not installed; the
``*ImageProcessorPil`` classes import without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from flashvlm.processing.clip_image import ClipImageProcessor
from flashvlm.processing.hashing import hash_image
from flashvlm.processing.preprocess import get_image_processor
from flashvlm.processing.qwen_image import QwenImageProcessor, smart_resize
from flashvlm.request import InvalidRequestError

PIXEL_TOL = 1e-2  # see module docstring

# Qwen2-VL-7B-Instruct's preprocessor_config.json (old form), with small pixel bounds for speed.
QWEN_CFG = {
    "min_pixels": 3136, "max_pixels": 28 * 28 * 256, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
}
# llava-hf/llava-1.5-7b-hf's preprocessor_config.json.
LLAVA_CFG = {
    "crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "do_convert_rgb": True,
    "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_processor_type": "CLIPImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711], "processor_class": "LlavaProcessor",
    "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336},
}
_META_KEYS = ("image_processor_type", "processor_class")


def rand_image(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def hf_qwen(min_pixels: int, max_pixels: int) -> Qwen2VLImageProcessorPil:
    # Always pass a fresh ``size`` dict: HF's __init__ writes min/max_pixels into the dict it is
    # given, and with no ``size`` that dict is the class attribute, leaking into later instances.
    return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------- Qwen2-VL / Qwen2.5-VL

QWEN_CASES = [  # (width, height, min_pixels, max_pixels)
    (56, 112, 3136, 28 * 28 * 256),
    (140, 84, 3136, 28 * 28 * 256),
    (28, 28, 3136, 28 * 28 * 256),  # upscaled to min_pixels
    (97, 203, 3136, 28 * 28 * 256),  # odd sizes
    (1000, 700, 3136, 28 * 28 * 256),  # max_pixels limits
    (1000, 700, 3136, 28 * 28 * 64),
    (7, 900, 3136, 28 * 28 * 128),  # extreme aspect ratio
    (333, 251, 28 * 28 * 16, 28 * 28 * 1280),
    (1, 1, 3136, 28 * 28 * 256),
]


@pytest.mark.parametrize("w,h,lo,hi", QWEN_CASES)
def test_qwen_matches_hf(w: int, h: int, lo: int, hi: int) -> None:
    img = rand_image(w, h, seed=w * 7 + h)
    ref = hf_qwen(lo, hi)(img, return_tensors="pt")
    ours = QwenImageProcessor.from_config({**QWEN_CFG, "min_pixels": lo, "max_pixels": hi})
    pv, grid = ours.preprocess(img)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert pv.dtype == torch.float32
    assert max_diff(pv, ref["pixel_values"]) <= PIXEL_TOL
    # Token count as HF's processor derives it (patches // merge_size**2).
    hf_patches = hf_qwen(lo, hi).get_number_of_image_patches(h, w)
    assert pv.shape[0] == hf_patches
    assert ours.num_image_tokens(grid) == hf_patches // 4
    assert ours.grid_thw(h, w) == tuple(grid)


def test_cpu_path_is_bit_exact() -> None:
    img = rand_image(211, 157, seed=1)
    ref = hf_qwen(3136, 28 * 28 * 256)(img, return_tensors="pt")["pixel_values"]
    pv, _ = QwenImageProcessor.from_config(QWEN_CFG).preprocess(img)
    assert torch.equal(pv, ref)


def test_compact_rows_decode_to_the_model_ready_pixels() -> None:
    """The engine's host path: the resized uint8 image (an eighth of the float bytes), finished by
    decode_compact (patchify, normalize, temporal copy) into exactly transformers' pixel_values."""
    img = rand_image(211, 157, seed=2)
    proc = QwenImageProcessor.from_config(QWEN_CFG)
    compact, grid = proc.preprocess_compact(img)
    ref = hf_qwen(3136, 28 * 28 * 256)(img, return_tensors="pt")["pixel_values"]
    h, w = proc.target_size(157, 211)
    assert compact.dtype == torch.uint8 and compact.shape == (h, w, 3) and compact.numel() * 8 == ref.numel() * 4
    assert torch.equal(proc.decode_compact(compact), ref) and grid == proc.grid_thw(157, 211)


def test_qwen_per_request_override_matches_hf() -> None:
    img = rand_image(1000, 700, seed=2)
    proc = QwenImageProcessor.from_config({**QWEN_CFG, "max_pixels": 28 * 28 * 1280})
    ref = hf_qwen(3136, 28 * 28 * 1280)(img, min_pixels=3136, max_pixels=28 * 28 * 32, return_tensors="pt")
    pv, grid = proc.preprocess(img, min_pixels=3136, max_pixels=28 * 28 * 32)
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert max_diff(pv, ref["pixel_values"]) <= PIXEL_TOL


def test_qwen_single_override_is_honoured() -> None:
    # HF ignores a lone max_pixels at call time; we combine it with the configured min_pixels.
    proc = QwenImageProcessor.from_config(QWEN_CFG)
    full = proc.grid_thw(700, 1000)
    small = proc.grid_thw(700, 1000, max_pixels=28 * 28 * 16)
    assert small[1] * small[2] < full[1] * full[2]
    assert small[1] * small[2] * 14 * 14 <= 28 * 28 * 16
    big = proc.grid_thw(28, 28, min_pixels=28 * 28 * 16)
    assert big[1] * big[2] * 14 * 14 >= 28 * 28 * 16


def test_qwen_temporal_repeat_and_layout() -> None:
    proc = QwenImageProcessor.from_config(QWEN_CFG)
    pv, (t, gh, gw) = proc.preprocess(rand_image(84, 56, seed=3))
    assert t == 1 and pv.shape == (gh * gw, 3 * 2 * 14 * 14)
    v = pv.view(-1, 3, 2, 14, 14)
    assert torch.equal(v[:, :, 0], v[:, :, 1])  # one image is repeated over temporal_patch_size


@pytest.mark.parametrize("bad", [
    dict(min_pixels=0), dict(max_pixels=-5), dict(min_pixels=5000, max_pixels=4000),
    dict(max_pixels=1.5), dict(min_pixels=True), dict(max_pixels=10**12),  # last: above the server limit
])
def test_qwen_bad_overrides(bad: dict) -> None:
    proc = QwenImageProcessor.from_config(QWEN_CFG)
    with pytest.raises(InvalidRequestError, match="pixels"):
        proc.preprocess(rand_image(56, 56), **bad)


def test_qwen_extreme_aspect_ratio_refused() -> None:
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        QwenImageProcessor().preprocess(rand_image(1, 300))


@pytest.mark.parametrize("do_pad", [False, True])
def test_clip_sliver_images_refused_before_resizing(do_pad: bool) -> None:
    """A 1x8000 PNG is 100 bytes, but its shortest-edge resize would be 336x2,688,000 (gigabytes)."""
    proc = ClipImageProcessor(do_pad=do_pad)
    with pytest.raises(InvalidRequestError, match="aspect ratio"):
        proc.preprocess(Image.new("RGB", (8000, 1)))
    assert proc.preprocess(rand_image(2, 300)).shape == (3, 336, 336)  # ratio 150: served


def test_clip_pad_canvas_bounded() -> None:
    with pytest.raises(InvalidRequestError, match="square"):
        ClipImageProcessor(do_pad=True).preprocess(Image.new("RGB", (17000, 100)))


def test_smart_resize_matches_hf_on_many_sizes() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    rng = np.random.default_rng(4)
    for h, w in rng.integers(1, 3000, (400, 2)):
        h, w = int(h), int(w)
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in ((3136, 28 * 28 * 1280), (28 * 28 * 4, 28 * 28 * 64)):
            assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, 28, lo, hi), (h, w, lo, hi)


def test_qwen_config_forms() -> None:
    old = QwenImageProcessor.from_config({"min_pixels": 100, "max_pixels": 5000})
    new = QwenImageProcessor.from_config({"size": {"shortest_edge": 100, "longest_edge": 5000}})
    assert (old.min_pixels, old.max_pixels) == (new.min_pixels, new.max_pixels) == (100, 5000)
    both = QwenImageProcessor.from_config({"size": {"shortest_edge": 1, "longest_edge": 2},
                                           "max_pixels": 9000})
    assert (both.min_pixels, both.max_pixels) == (1, 9000)  # top-level keys win, as in HF
    with pytest.raises(ValueError):
        QwenImageProcessor.from_config({"min_pixels": 10, "max_pixels": 5})
    with pytest.raises(ValueError):
        QwenImageProcessor.from_config({"patch_size": 0})


# ---------------------------------------------------------------- CLIP / LLaVA-1.5

CLIP_SIZES = [(56, 112), (640, 480), (200, 1000), (336, 336), (100, 50), (337, 335), (3, 500)]


@pytest.mark.parametrize("w,h", CLIP_SIZES)
def test_clip_matches_hf(w: int, h: int) -> None:
    img = rand_image(w, h, seed=w + 3 * h)
    cfg = {k: v for k, v in LLAVA_CFG.items() if k not in _META_KEYS}
    ref = CLIPImageProcessorPil(**cfg)(img, return_tensors="pt")["pixel_values"][0]
    pv = ClipImageProcessor.from_config(LLAVA_CFG).preprocess(img)
    assert pv.shape == (3, 336, 336) and pv.dtype == torch.float32
    assert max_diff(pv, ref) <= PIXEL_TOL


@pytest.mark.parametrize("w,h", [(56, 112), (640, 480), (101, 37), (336, 336)])
def test_llava_pad_to_square_matches_hf(w: int, h: int) -> None:
    img = rand_image(w, h, seed=w * h)
    cfg = {**{k: v for k, v in LLAVA_CFG.items() if k not in _META_KEYS}, "do_pad": True}
    ref = LlavaImageProcessorPil(**cfg)(img, return_tensors="pt")["pixel_values"][0]
    pv = ClipImageProcessor.from_config({**LLAVA_CFG, "do_pad": True}).preprocess(img)
    assert max_diff(pv, ref) <= PIXEL_TOL


@pytest.mark.parametrize("cfg_update", [
    {"size": {"shortest_edge": 224}},  # crop larger than the resize: HF zero-pads inside the crop
    {"size": {"height": 300, "width": 280}},
    {"do_center_crop": False, "size": {"height": 336, "width": 336}},
    {"do_normalize": False},
    {"resample": 2},
])
def test_clip_config_variants_match_hf(cfg_update: dict) -> None:
    img = rand_image(250, 180, seed=9)
    cfg = {**{k: v for k, v in LLAVA_CFG.items() if k not in _META_KEYS}, **cfg_update}
    ref = CLIPImageProcessorPil(**cfg)(img, return_tensors="pt")["pixel_values"][0]
    pv = ClipImageProcessor.from_config(cfg).preprocess(img)
    assert max_diff(pv, ref) <= PIXEL_TOL


def test_clip_num_image_tokens() -> None:
    proc = ClipImageProcessor.from_config(LLAVA_CFG)
    assert proc.num_image_tokens(patch_size=14) == 576  # 'default' drops CLS: (336/14)^2
    assert proc.num_image_tokens(patch_size=14, select_strategy="full") == 577
    with pytest.raises(ValueError):
        proc.num_image_tokens(14, select_strategy="bogus")


# ---------------------------------------------------------------- factory and hashing


def test_get_image_processor() -> None:
    assert isinstance(get_image_processor(QWEN_CFG, "qwen2_vl"), QwenImageProcessor)
    assert isinstance(get_image_processor(QWEN_CFG, "qwen2_5_vl"), QwenImageProcessor)
    assert isinstance(get_image_processor(LLAVA_CFG, "llava"), ClipImageProcessor)
    with pytest.raises(ValueError, match="model_type"):
        get_image_processor({}, "gpt2")


def test_processor_params_feed_the_hash() -> None:
    img = rand_image(64, 48, seed=11)
    qwen = QwenImageProcessor.from_config(QWEN_CFG)
    base = hash_image(img, qwen.processor_params())
    assert hash_image(img, qwen.processor_params()) == base
    assert hash_image(img, qwen.processor_params(max_pixels=28 * 28 * 32)) != base
    assert hash_image(img, qwen.processor_params(min_pixels=28 * 28 * 8)) != base
    clip = ClipImageProcessor.from_config(LLAVA_CFG)
    assert hash_image(img, clip.processor_params()) != base
