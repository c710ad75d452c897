"""load_image over every accepted source, every refused input, and the image content hash."""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from flashvlm.processing.hashing import hash_image, hash_pixels
from flashvlm.processing.images import load_image, rgb_array
from flashvlm.request import InvalidRequestError

PARAMS = {"family": "qwen2_vl", "min_pixels": 3136, "max_pixels": 200_704}


def rand_array(h: int = 37, w: int = 53, c: int | None = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w) if c is None else (h, w, c)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def png_bytes(img: Image.Image, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.fixture
def rgb() -> Image.Image:
    return Image.fromarray(rand_array())


# ---------------------------------------------------------------- accepted sources


def test_pil_rgb_passthrough(rgb: Image.Image) -> None:
    out = load_image(rgb)
    assert out.mode == "RGB" and out.size == rgb.size
    assert np.array_equal(np.asarray(out), np.asarray(rgb))


@pytest.mark.parametrize("mode", ["1", "L", "LA", "P", "PA", "RGBA", "RGBX", "CMYK", "YCbCr"])
def test_convertible_modes_match_plain_convert(rgb: Image.Image, mode: str) -> None:
    # HF's convert_rgb is a plain .convert("RGB") (alpha dropped, not composited); we must agree.
    src = rgb.convert(mode)
    out = load_image(src)
    assert out.mode == "RGB"
    assert np.array_equal(np.asarray(out), np.asarray(src.convert("RGB")))


def test_numpy_rgb_gray_rgba_and_single_channel() -> None:
    a3 = rand_array()
    assert np.array_equal(np.asarray(load_image(a3)), a3)
    a2 = rand_array(c=None, seed=1)
    assert np.array_equal(np.asarray(load_image(a2)), np.repeat(a2[:, :, None], 3, axis=2))
    assert np.array_equal(np.asarray(load_image(a2[:, :, None])), np.asarray(load_image(a2)))
    a4 = rand_array(c=4, seed=2)
    assert np.array_equal(np.asarray(load_image(a4)), a4[:, :, :3])


def test_numpy_float_and_wide_int() -> None:
    a = rand_array(seed=3)
    # uint8 -> [0, 1] float -> uint8 must round-trip exactly (we round, not truncate).
    assert np.array_equal(np.asarray(load_image(a.astype(np.float32) / 255.0)), a)
    assert np.array_equal(np.asarray(load_image(a.astype(np.int64))), a)


def test_numpy_non_contiguous(rgb: Image.Image) -> None:
    a = rand_array(seed=4)[:, ::2]
    assert np.array_equal(np.asarray(load_image(a)), a)


def test_paths_bytes_and_data_uri_agree(tmp_path: Path, rgb: Image.Image) -> None:
    data = png_bytes(rgb)
    f = tmp_path / "x.png"
    f.write_bytes(data)
    uri = data_uri(data)
    wrapped = uri[:40] + "\n" + uri[40:]  # clients wrap long base64 lines
    sources = [f, str(f), f"file://{f}", data, bytearray(data), memoryview(data), uri, wrapped]
    for src in sources:
        out = load_image(src)
        assert out.mode == "RGB", src
        assert np.array_equal(np.asarray(out), np.asarray(rgb)), type(src)


def test_jpeg_bytes_decode() -> None:
    buf = io.BytesIO()
    Image.fromarray(rand_array(64, 48)).save(buf, format="JPEG")
    out = load_image(buf.getvalue())
    assert out.mode == "RGB" and out.size == (48, 64)


def test_exif_orientation_applied(rgb: Image.Image) -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    data = png_bytes(rgb, exif=exif)
    out = load_image(data)
    assert out.size == (rgb.height, rgb.width)
    assert np.array_equal(np.asarray(out), np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data)))))


# ---------------------------------------------------------------- refused inputs


def expect_error(src: object, *words: str, **kw: object) -> str:
    with pytest.raises(InvalidRequestError) as ei:
        load_image(src, **kw)
    msg = str(ei.value).lower()
    for w in words:
        assert w in msg, msg
    return msg


def test_corrupt_bytes() -> None:
    junk = np.random.default_rng(5).integers(0, 256, 500, dtype=np.uint8).tobytes()
    expect_error(junk, "cannot decode", "corrupt")
    expect_error(b"", "empty")


def test_truncated_png(rgb: Image.Image) -> None:
    data = png_bytes(Image.fromarray(rand_array(200, 200, seed=6)))
    expect_error(data[: len(data) // 2], "corrupt")


def test_bad_base64_and_bad_data_uris() -> None:
    expect_error("data:image/png;base64,@@@not-base64!!", "invalid base64")
    expect_error("data:image/png;base64,", "no data")
    expect_error("data:image/png,rawdata", "base64")
    expect_error("data:text/plain;base64,aGVsbG8=", "media type")
    expect_error("data:image/png;base64" + "AAAA", "malformed")
    expect_error(data_uri(b"not an image at all"), "cannot decode")


def test_zero_size() -> None:
    expect_error(Image.new("RGB", (0, 10)), "zero-size")
    expect_error(Image.new("RGB", (10, 0)), "zero-size")
    expect_error(np.zeros((0, 5, 3), dtype=np.uint8), "zero-size")


@pytest.mark.parametrize("mode", ["HSV", "LAB"])
def test_unsupported_mode(mode: str) -> None:
    msg = expect_error(Image.new(mode, (4, 4)), "unsupported image mode", mode.lower())
    assert "rgb" in msg


def _grey16(seed: int = 7) -> np.ndarray:
    arr = np.random.default_rng(seed).integers(0, 65536, (9, 11), dtype=np.uint16)
    arr[0, :4] = [0, 65535, 128, 32768]  # both ends and a value PIL's clipping convert would also keep
    return arr


def _expect_grey(out: Image.Image, grey: np.ndarray) -> None:
    assert out.mode == "RGB" and out.size == (grey.shape[1], grey.shape[0])
    assert np.array_equal(np.asarray(out), np.repeat(grey[:, :, None], 3, axis=2))


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_16bit_grey_file_is_scaled_not_clipped(fmt: str) -> None:
    arr = _grey16()
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    assert Image.open(io.BytesIO(buf.getvalue())).mode in ("I;16", "I")
    _expect_grey(load_image(buf.getvalue()), np.rint(arr / 257.0).astype(np.uint8))


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I;16L", "I"])
def test_16bit_modes_scale_their_range(mode: str) -> None:
    arr = _grey16(seed=3)
    if mode == "I":
        src = Image.fromarray(arr.astype(np.int32))
    else:
        src = Image.frombytes(mode, (arr.shape[1], arr.shape[0]), arr.astype(">u2" if mode == "I;16B" else "<u2")
                              .tobytes())
    assert src.mode == mode
    _expect_grey(load_image(src), np.rint(arr / 257.0).astype(np.uint8))


def test_8bit_content_widened_to_16_bits_comes_back_exactly() -> None:
    grey = rand_array(c=None, seed=5)
    _expect_grey(load_image(png_bytes(Image.fromarray(grey.astype(np.uint16) * 257))), grey)


def test_float_mode_reads_zero_to_one() -> None:
    arr = np.random.default_rng(2).random((6, 5)).astype(np.float32)
    arr[0, :2] = [0.0, 1.0]
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="TIFF")
    _expect_grey(load_image(buf.getvalue()), np.rint(arr.astype(np.float64) * 255).astype(np.uint8))


@pytest.mark.parametrize("values,needle", [
    (np.array([[0.5, 2.0]], dtype=np.float32), "[0, 1]"),
    (np.array([[0.5, np.nan]], dtype=np.float32), "finite"),
    (np.array([[0, 70000]], dtype=np.int32), "[0, 65535]"),
    (np.array([[-1, 5]], dtype=np.int32), "[0, 65535]"),
])
def test_high_depth_values_without_one_reading_are_refused(values: np.ndarray, needle: str) -> None:
    expect_error(Image.fromarray(values), needle)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    expect_error(str(tmp_path / "nope.png"), "not found", "nope.png")
    expect_error(tmp_path / "nope.jpg", "not found")
    expect_error(tmp_path, "directory")
    expect_error("", "empty")


def test_unknown_input_types() -> None:
    for bad in (42, 3.5, None, ["a"], {"url": "x"}):
        expect_error(bad, "unsupported image input type")
    expect_error("https://example.com/cat.png", "remote")


def test_bad_arrays() -> None:
    expect_error(np.zeros((4, 4, 2), dtype=np.uint8), "shape")
    expect_error(np.zeros((4,), dtype=np.uint8), "shape")
    expect_error(np.full((4, 4, 3), 1.5, dtype=np.float32), "[0, 1]")
    expect_error(np.full((4, 4, 3), np.nan, dtype=np.float32), "finite")
    expect_error(np.full((4, 4, 3), 300, dtype=np.int32), "[0, 255]")
    expect_error(np.zeros((4, 4, 3), dtype=bool), "dtype")


def test_rgb_array_fast_path_validates_and_hashes_like_load_image(rgb: Image.Image) -> None:
    """rgb_array (the input processor's path for a three-channel array) refuses what load_image refuses, gives the
    pixels load_image gives, and hashes them as the PIL image does; other inputs are not its business (None)."""
    for bad, words in ((np.full((4, 4, 3), 1.5, dtype=np.float32), "[0, 1]"),
                       (np.full((4, 4, 3), np.nan, dtype=np.float32), "finite"),
                       (np.full((4, 4, 3), 300, dtype=np.int32), "[0, 255]"),
                       (np.zeros((4, 4, 3), dtype=bool), "dtype"), (np.zeros((0, 4, 3), dtype=np.uint8), "zero-size")):
        with pytest.raises(InvalidRequestError, match=re.escape(words)):
            rgb_array(bad)
    with pytest.raises(InvalidRequestError, match="too large"):
        rgb_array(np.zeros((120, 100, 3), dtype=np.uint8), max_image_pixels=10_000)
    for other in (rgb, np.zeros((4, 4), dtype=np.uint8), np.zeros((4, 4, 4), dtype=np.uint8), b"png"):
        assert rgb_array(other) is None
    source = np.asarray(rgb)[::-1]  # a non-contiguous view
    arr = rgb_array(source)
    assert arr.flags.c_contiguous and arr.dtype == np.uint8
    img = load_image(source)
    assert np.array_equal(arr, np.asarray(img))
    assert hash_pixels("RGB", img.width, img.height, PARAMS, arr) == hash_image(img, PARAMS)
    floats = rgb_array(np.asarray(rgb) / 255.0)  # floats in [0, 1] round back to the same bytes
    assert np.array_equal(floats, np.asarray(rgb))


def test_too_many_pixels(tmp_path: Path) -> None:
    big = Image.fromarray(rand_array(120, 100, seed=8))
    expect_error(big, "too large", "12000", max_image_pixels=10_000)
    expect_error(np.asarray(big), "too large", max_image_pixels=10_000)
    # Encoded input is refused from its header, before the pixel data is decoded (bomb guard).
    expect_error(png_bytes(big), "too large", max_image_pixels=10_000)
    assert load_image(big, max_image_pixels=None).size == (100, 120)
    assert load_image(big, max_image_pixels=12_000).size == (100, 120)


def test_next_request_still_works_after_errors(rgb: Image.Image) -> None:
    for bad in (b"\x00garbage", Image.new("HSV", (2, 2)), "data:image/png;base64,###"):
        with pytest.raises(InvalidRequestError):
            load_image(bad)
    assert load_image(png_bytes(rgb)).size == rgb.size


# ---------------------------------------------------------------- content hash


def test_hash_same_picture_any_source(tmp_path: Path, rgb: Image.Image) -> None:
    data = png_bytes(rgb)
    f = tmp_path / "x.png"
    f.write_bytes(data)
    hashes = {hash_image(load_image(s), PARAMS)
              for s in (rgb, np.asarray(rgb), data, str(f), f, data_uri(data), rgb.convert("RGBA"))}
    assert len(hashes) == 1
    h = hashes.pop()
    assert len(h) == 32 and int(h, 16) >= 0  # 128-bit XXH3 digest


def test_hash_param_order_and_types_do_not_matter(rgb: Image.Image) -> None:
    a = {"image_mean": (0.5, 0.5, 0.5), "min_pixels": np.int64(3136), "max_pixels": 200_704}
    b = {"max_pixels": 200_704, "min_pixels": 3136, "image_mean": [0.5, 0.5, 0.5]}
    assert hash_image(rgb, a) == hash_image(rgb, b)


def test_hash_differs_on_pixels_size_and_params() -> None:
    a = rand_array(seed=10)
    base = hash_image(load_image(a), PARAMS)
    b = a.copy()
    b[0, 0, 0] ^= 1  # one bit of one pixel
    assert hash_image(load_image(b), PARAMS) != base
    # Same bytes, other shape: the size is part of the hash.
    reshaped = a.reshape(a.shape[1], a.shape[0], 3)
    assert hash_image(load_image(reshaped), PARAMS) != base
    assert hash_image(load_image(a), {**PARAMS, "max_pixels": 100_352}) != base
    assert hash_image(load_image(a), {**PARAMS, "min_pixels": 1568}) != base
    assert hash_image(load_image(a), {**PARAMS, "family": "clip"}) != base


def test_device_files_and_oversized_files_are_refused(tmp_path, monkeypatch) -> None:
    import flashvlm.processing.images as images_mod

    with pytest.raises(InvalidRequestError, match="not a regular file"):
        load_image("/dev/zero")
    big = tmp_path / "big.png"
    big.write_bytes(b"\x89PNG" + b"\0" * 4096)
    monkeypatch.setattr(images_mod, "MAX_IMAGE_FILE_BYTES", 1024)
    with pytest.raises(InvalidRequestError, match="limit is 1024"):
        load_image(str(big))
