"""Images in modes with a faithful RGB conversion are served: 16-bit and float greyscale (scaled, not clipped),
greyscale with alpha, palette with transparency, CMYK. The pixels the engine sees are checked through the
prefix cache: the image's tokens are keyed by a hash of its RGB pixels, so a 16-bit picture whose values are
an 8-bit picture's times 257 must hit the cache the 8-bit one filled, exactly as a repeat of that one does."""

from __future__ import annotations

import io
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.server.conftest import MODEL, LiveServer, data_uri, image_message

_SIDE = 112  # 16 image tokens on the tiny model: several KV blocks of them
_TEXT = "Describe the picture in a few careful words, please, and name every shape you can see in it."


def _grey(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (_SIDE, _SIDE), dtype=np.uint8)


def _encode(img: Image.Image, fmt: str = "PNG", **kw: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _palette_with_transparency() -> bytes:
    img = Image.fromarray(np.random.default_rng(4).integers(0, 256, (_SIDE, _SIDE, 3), dtype=np.uint8))
    return _encode(img.quantize(16), transparency=0)


def _modes() -> list[tuple[str, bytes, str, str]]:
    grey = _grey(1)
    rng = np.random.default_rng(2)
    return [
        ("I;16-png", _encode(Image.fromarray(grey.astype(np.uint16) * 257)), "image/png", "I;16"),
        ("I-tiff", _encode(Image.fromarray(grey.astype(np.int32) * 257), "TIFF"), "image/tiff", "I"),
        ("F-tiff", _encode(Image.fromarray(grey.astype(np.float32) / 255), "TIFF"), "image/tiff", "F"),
        ("LA-png", _encode(Image.fromarray(np.stack([grey, grey[::-1]], axis=2))), "image/png", "LA"),
        ("P-transparency", _palette_with_transparency(), "image/png", "P"),
        ("CMYK-jpeg", _encode(Image.fromarray(rng.integers(0, 256, (_SIDE, _SIDE, 3), dtype=np.uint8))
                              .convert("CMYK"), "JPEG"), "image/jpeg", "CMYK"),
    ]


def _chat(live: LiveServer, uri: str) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": image_message(_TEXT, uri)}
    r = httpx.post(live.v1 + "/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text[:300]
    return r.json()


@pytest.mark.parametrize("case", _modes(), ids=[m[0] for m in _modes()])
def test_mode_is_served(live: LiveServer, case: tuple[str, bytes, str, str]) -> None:
    _, data, mime, mode = case
    assert Image.open(io.BytesIO(data)).mode == mode
    assert _chat(live, data_uri(data, mime))["usage"]["completion_tokens"] == 1


def test_16bit_and_float_grey_reach_the_engine_as_the_8bit_picture(live: LiveServer) -> None:
    grey = _grey(9)
    eight = data_uri(_encode(Image.fromarray(grey)))
    first = _chat(live, eight)["usage"]
    repeat = _chat(live, eight)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert repeat > first["prompt_tokens_details"]["cached_tokens"]  # the repeat hit the cache past the image
    brighter = np.clip(grey.astype(int) + 1, 0, 255).astype(np.uint8)
    other = _chat(live, data_uri(_encode(Image.fromarray(brighter))))["usage"]
    assert other["prompt_tokens_details"]["cached_tokens"] < repeat  # different pixels: the cache stops at them
    wide = [_encode(Image.fromarray(grey.astype(np.uint16) * 257)),
            _encode(Image.fromarray(grey.astype(np.int32) * 257), "TIFF"),
            _encode(Image.fromarray(grey.astype(np.float32) / 255), "TIFF")]
    for data, mime in zip(wide, ["image/png", "image/tiff", "image/tiff"], strict=True):
        usage = _chat(live, data_uri(data, mime))["usage"]
        assert usage["prompt_tokens"] == first["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == repeat, mime
