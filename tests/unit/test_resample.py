"""The batched preprocessing steps give exactly what their one-at-a-time forms give: threaded Pillow resizes
(processing/resample.py), the table normalization (`lookup_normalize`) and LLaVA-NeXT's all-tiles-at-once path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flashvlm.processing.llava_next_image import LlavaNextImageProcessor
from flashvlm.processing.preprocess import PixelSettings, lookup_normalize, normalize
from flashvlm.processing.resample import resize_frames, resize_images


@pytest.fixture(params=[1, 3])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape,target,resample", [
    ((5, 36, 64), (40, 70), Image.Resampling.BICUBIC),
    ((4, 90, 50), (30, 20), Image.Resampling.BILINEAR),
    ((3, 17, 29), (17, 64), Image.Resampling.LANCZOS),
])
def test_resize_frames_is_pillow_per_frame(threads: int, shape: tuple, target: tuple, resample: int) -> None:
    frames = np.random.default_rng(threads).integers(0, 256, (*shape, 3), dtype=np.uint8)
    want = np.stack([np.asarray(Image.fromarray(f).resize(target[::-1], resample=resample)) for f in frames])
    got = resize_frames(frames, *target, int(resample))
    assert got.dtype == np.uint8 and np.array_equal(got, want)


def test_resize_images_keeps_order_and_same_size_images(threads: int) -> None:
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)) for i in range(4)]
    sizes = [(10, 15), (21, 30), (40, 9), (5, 5)]
    got = resize_images(images, sizes, int(Image.Resampling.BICUBIC))
    assert got[1] is images[1]
    for img, hw, out in zip(images, sizes, got):
        assert np.array_equal(np.asarray(out), np.asarray(img.resize(hw[::-1], resample=Image.Resampling.BICUBIC)))


@pytest.mark.parametrize("settings", [{}, {"do_rescale": False}, {"do_normalize": False},
                                      {"image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5)}])
def test_lookup_normalize_is_normalize(settings: dict) -> None:
    proc = PixelSettings(**settings)
    levels = np.random.default_rng(1).integers(0, 256, (2, 7, 9, 3), dtype=np.uint8)
    want = torch.stack([normalize(x, proc, None).permute(2, 0, 1) for x in levels])
    got = lookup_normalize(torch.from_numpy(levels), proc)
    assert got.shape == (2, 3, 7, 9) and got.is_contiguous() and torch.equal(got, want)


@pytest.mark.parametrize("hw", [(756, 1008), (100, 700), (336, 336), (500, 90)])
def test_llava_next_tiles_at_once_match_tile_by_tile(hw: tuple[int, int], threads: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    proc = LlavaNextImageProcessor.from_config({"image_grid_pinpoints": [[336, 672], [672, 336], [672, 672],
                                                                         [1008, 336], [336, 1008]]})
    img = Image.fromarray(np.random.default_rng(hw[0]).integers(0, 256, (*hw, 3), dtype=np.uint8))
    assert proc._tiles_only_normalize()
    fast = proc.preprocess(img)
    monkeypatch.setattr(LlavaNextImageProcessor, "_tiles_only_normalize", lambda self: False)
    assert torch.equal(fast, proc.preprocess(img))
