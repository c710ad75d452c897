"""processing/device_resize.py against the installed Pillow, and Qwen images resized where they are decoded against
the host path: bit for bit, on fresh random pixels."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flashvlm.processing.device_resize import resize_like_pillow, supports
from flashvlm.processing.pixel_cache import PixelCache
from flashvlm.processing.preprocess import SourceImage
from flashvlm.processing.qwen_image import QwenImageInputs, QwenImageProcessor

FILTERS = [Image.Resampling.BICUBIC, Image.Resampling.BILINEAR]


def _pillow(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    return np.asarray(Image.fromarray(pixels).resize((width, height), resample=resample))


@pytest.mark.parametrize("resample", FILTERS)
def test_equals_pillow_on_many_sizes(resample: int) -> None:
    rng = np.random.default_rng(int(resample))
    # Up, down and mixed on each axis, one-pixel sides, and heights shrinking by more than twice the width's
    # change (the pass order Pillow 13 switches on).
    shapes = [tuple(int(v) for v in rng.integers(1, 70, 4)) for _ in range(150)]
    shapes += [(60, 20, 10, 19), (64, 64, 17, 200), (5, 7, 1, 1), (1, 1, 9, 13), (40, 40, 39, 41)]
    for h, w, out_h, out_w in shapes:
        pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        ours = resize_like_pillow(torch.from_numpy(pixels.copy()), out_h, out_w, resample)
        assert np.array_equal(ours.numpy(), _pillow(pixels, out_h, out_w, resample)), (h, w, out_h, out_w)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [(756, 1008, 768, 1024), (1080, 1920, 1092, 1932), (900, 1200, 448, 1176)])
def test_equals_pillow_at_photo_sizes(device: str, size: tuple[int, int, int, int]) -> None:
    h, w, out_h, out_w = size  # the last shrinks the height by more than twice the width's change
    pixels = np.random.default_rng(h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    ours = resize_like_pillow(torch.from_numpy(pixels.copy()).to(device), out_h, out_w, Image.Resampling.BICUBIC)
    assert np.array_equal(ours.cpu().numpy(), _pillow(pixels, out_h, out_w, Image.Resampling.BICUBIC))


def test_refuses_what_it_does_not_reproduce() -> None:
    assert not supports(Image.Resampling.LANCZOS) and supports(Image.Resampling.BICUBIC)
    with pytest.raises(ValueError, match="bilinear and bicubic"):
        resize_like_pillow(torch.zeros(4, 4, 3, dtype=torch.uint8), 2, 2, Image.Resampling.LANCZOS)
    with pytest.raises(ValueError, match="uint8"):
        resize_like_pillow(torch.zeros(4, 4, 3), 2, 2, Image.Resampling.BICUBIC)


@pytest.mark.parametrize("size", [(133, 97), (400, 60), (600, 400)])
def test_qwen_items_resized_where_decoded_equal_the_host_path(size: tuple[int, int]) -> None:
    w, h = size
    pixels = np.random.default_rng(w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    proc = QwenImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    host = QwenImageInputs(proc).make_item(SourceImage(array=pixels), {}, PixelCache(0), None)
    deferred = QwenImageInputs(proc, resize_where_decoded=True).make_item(SourceImage(array=pixels), {},
                                                                           PixelCache(0), None)
    source_kept = tuple(deferred.pixel_values.shape[:2]) == (h, w)
    assert source_kept == (h * w <= QwenImageInputs.MAX_DEFERRED_SCALE * host.pixel_values.shape[0]
                           * host.pixel_values.shape[1])
    assert (deferred.mm_hash, deferred.layout, deferred.num_tokens) == (host.mm_hash, host.layout, host.num_tokens)
    assert torch.equal(deferred.model_pixels(), host.model_pixels())
    assert torch.equal(QwenImageInputs(proc).token_pixels(deferred), QwenImageInputs(proc).token_pixels(host))
