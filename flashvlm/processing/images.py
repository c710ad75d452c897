"""Load and validate request images from every accepted source into an RGB PIL image.

Accepted sources: a PIL image, a numpy array (HxW, HxWx1, HxWx3, HxWx4; uint8/integer in [0, 255]
or float in [0, 1]), a file path (``str`` or ``pathlib.Path``, optionally ``file://``), raw bytes
and a ``data:image/...;base64,...`` URI. Every failure raises ``InvalidRequestError`` whose message
names the problem, so the server can answer 400 and other requests carry on.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from flashvlm.request import InvalidRequestError

DEFAULT_MAX_IMAGE_PIXELS = 64_000_000
MAX_IMAGE_FILE_BYTES = 64 * 2**20
"""Largest image file read from disk: a device file or a huge file must not hang or exhaust the host."""

# Modes whose ``convert("RGB")`` is meaningful. HF's ``convert_rgb`` does a plain convert (alpha is
# dropped, not composited), and we do the same to stay faithful to the reference processors.
_CONVERTIBLE_MODES = frozenset(
    {"1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr"}
)
_HIGH_DEPTH_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})
"""Greyscale of more than 8 bits, reduced to 8 by scaling its range: PIL's own convert clips at 255, which
turns almost every 16-bit pixel white."""
_EXIF_ORIENTATION = 0x0112

__all__ = ["DEFAULT_MAX_IMAGE_PIXELS", "ImageSource", "load_image", "rgb_array"]

ImageSource = Image.Image | np.ndarray | str | os.PathLike | bytes | bytearray | memoryview


def load_image(src: Any, max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Decode ``src`` into a validated RGB ``PIL.Image.Image``.

    ``max_image_pixels`` bounds width*height (checked from the header, before pixels are decoded,
    so a decompression bomb is refused cheaply); ``None`` disables our limit, though Pillow's own
    bomb guard still applies to encoded inputs.
    """
    if isinstance(src, Image.Image):
        img = src
    elif isinstance(src, np.ndarray):
        img = _from_array(src, max_image_pixels)
    elif isinstance(src, (bytes, bytearray, memoryview)):
        img = _decode(bytes(src), "image bytes", max_image_pixels)
    elif isinstance(src, str):
        img = _from_string(src, max_image_pixels)
    elif isinstance(src, os.PathLike):
        img = _from_path(Path(src), max_image_pixels)
    else:
        raise InvalidRequestError(
            f"unsupported image input type {type(src).__name__}: expected a PIL image, numpy array, "
            "file path, bytes or a data:image/...;base64 URI"
        )
    return _finalize(img, max_image_pixels)


def rgb_array(src: Any, max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS) -> np.ndarray | None:
    """`src` as a validated C-contiguous uint8 (H, W, 3) array if it is a numpy array of three channels (the
    pixels load_image would give), else None. Lets a caller skip PIL's RGB -> RGBX -> RGB round trip (about
    3 ms for a 1008x756 picture) when it needs no resize. May return `src` itself: copy before keeping it."""
    if not isinstance(src, np.ndarray) or src.ndim != 3 or src.shape[2] != 3:
        return None
    return np.ascontiguousarray(_uint8_array(src, max_image_pixels))


def _check_size(width: int, height: int, max_image_pixels: int | None, what: str = "image") -> None:
    if width <= 0 or height <= 0:
        raise InvalidRequestError(f"zero-size {what}: {width}x{height} (width x height)")
    if max_image_pixels is not None and width * height > max_image_pixels:
        raise InvalidRequestError(
            f"{what} too large: {width}x{height} = {width * height} pixels exceeds the limit of "
            f"{max_image_pixels} pixels"
        )


def _from_string(src: str, max_image_pixels: int | None) -> Image.Image:
    if src.startswith("data:"):
        return _decode(_decode_data_uri(src), "data URI image", max_image_pixels)
    if src.startswith(("http://", "https://")):
        # Fetching is the server's job (timeouts, size caps); the engine never touches the network.
        raise InvalidRequestError("remote image URLs are not supported here; pass bytes or a data URI")
    if src.startswith("file://"):
        src = src[len("file://"):]
    if not src:
        raise InvalidRequestError("empty string given as an image source")
    return _from_path(Path(src), max_image_pixels)


def _decode_data_uri(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise InvalidRequestError("malformed data URI: no ',' separating the header from the data")
    media = header[len("data:"):].split(";")
    if "base64" not in media[1:]:
        raise InvalidRequestError(f"data URI must be base64-encoded (';base64'), got header {header!r}")
    if media[0] and not media[0].startswith("image/"):
        raise InvalidRequestError(f"data URI media type must be image/*, got {media[0]!r}")
    # Clients wrap long base64 lines; whitespace is not data, so drop it before strict validation.
    payload = "".join(payload.split())
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        try:  # tolerate the URL-safe alphabet some clients use
            data = base64.b64decode(payload, altchars=b"-_", validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidRequestError(f"invalid base64 in image data URI: {e}") from None
    if not data:
        raise InvalidRequestError("image data URI holds no data")
    return data


def _from_path(path: Path, max_image_pixels: int | None) -> Image.Image:
    try:
        info = path.stat()
        if path.is_dir():
            raise IsADirectoryError
        if not stat.S_ISREG(info.st_mode):
            raise InvalidRequestError(f"image path is not a regular file: {str(path)!r}")
        if info.st_size > MAX_IMAGE_FILE_BYTES:
            raise InvalidRequestError(f"image file {str(path)!r} is {info.st_size} bytes; "
                                      f"the limit is {MAX_IMAGE_FILE_BYTES}")
        with path.open("rb") as f:
            data = f.read(MAX_IMAGE_FILE_BYTES + 1)
    except FileNotFoundError:
        raise InvalidRequestError(f"image file not found: {str(path)!r}") from None
    except IsADirectoryError:
        raise InvalidRequestError(f"image path is a directory, not a file: {str(path)!r}") from None
    except PermissionError:
        raise InvalidRequestError(f"permission denied reading image file: {str(path)!r}") from None
    except OSError as e:  # e.g. name too long: a likely sign of raw base64 passed as a path
        raise InvalidRequestError(f"cannot read image file {str(path)[:200]!r}: {e.strerror or e}") from None
    return _decode(data, f"image file {str(path)!r}", max_image_pixels)


def _decode(data: bytes, what: str, max_image_pixels: int | None) -> Image.Image:
    if not data:
        raise InvalidRequestError(f"{what} is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            # Our own limit below is the guard; Pillow's warning would only be noise in server logs.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise InvalidRequestError(f"{what} refused as a decompression bomb: {e}") from None
    except UnidentifiedImageError:
        raise InvalidRequestError(
            f"cannot decode {what}: corrupt or not an image in a supported format ({len(data)} bytes)"
        ) from None
    except Exception as e:  # Pillow plugins raise assorted errors on malformed headers
        raise InvalidRequestError(f"cannot decode {what}: {type(e).__name__}: {e}") from None
    # The header gives the size before any pixel is decoded: refuse bombs and empty images here.
    _check_size(img.width, img.height, max_image_pixels, what)
    try:
        img.load()
    except Exception as e:  # truncated / corrupt pixel data
        raise InvalidRequestError(f"cannot decode {what}: corrupt or truncated image data ({e})") from None
    return img


def _from_array(arr: np.ndarray, max_image_pixels: int | None) -> Image.Image:
    # Pillow infers L / RGB / RGBA from a uint8 HxW / HxWx3 / HxWx4 array.
    return Image.fromarray(np.ascontiguousarray(_uint8_array(arr, max_image_pixels)))


def _uint8_array(arr: np.ndarray, max_image_pixels: int | None) -> np.ndarray:
    """A validated uint8 HxW, HxWx3 or HxWx4 array (floats in [0, 1] and integers in [0, 255] converted)."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (3, 4)):
        raise InvalidRequestError(
            f"unsupported image array shape {arr.shape}: expected HxW, HxWx1, HxWx3 or HxWx4 (channels last)"
        )
    _check_size(arr.shape[1], arr.shape[0], max_image_pixels, "image array")
    if arr.dtype == np.uint8:
        pass
    elif np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():
            raise InvalidRequestError("float image array holds NaN or infinite values; expected [0, 1]")
        if arr.min() < 0.0 or arr.max() > 1.0:
            raise InvalidRequestError(
                f"float image array must hold values in [0, 1], got range [{arr.min()}, {arr.max()}]"
            )
        # Round (not truncate) so that uint8 -> float -> uint8 round-trips exactly.
        arr = np.rint(arr.astype(np.float64) * 255.0).astype(np.uint8)
    elif np.issubdtype(arr.dtype, np.integer):
        if arr.min() < 0 or arr.max() > 255:
            raise InvalidRequestError(
                f"integer image array must hold values in [0, 255], got [{arr.min()}, {arr.max()}]"
            )
        arr = arr.astype(np.uint8)
    else:
        raise InvalidRequestError(f"unsupported image array dtype {arr.dtype}: expected uint8 or float")
    return arr


def _finalize(img: Image.Image, max_image_pixels: int | None) -> Image.Image:
    """Validate size and mode, apply EXIF orientation, convert to RGB (the HF ``load_image`` steps)."""
    _check_size(img.width, img.height, max_image_pixels)
    if img.mode not in _CONVERTIBLE_MODES | _HIGH_DEPTH_MODES:
        raise InvalidRequestError(
            f"unsupported image mode {img.mode!r}: it has no faithful 8-bit RGB conversion; supported modes are "
            f"{sorted(_CONVERTIBLE_MODES | _HIGH_DEPTH_MODES)}"
        )
    try:
        # Only transpose when an orientation tag asks for it; exif_transpose would otherwise copy.
        if img.getexif().get(_EXIF_ORIENTATION, 1) != 1:
            img = ImageOps.exif_transpose(img)
        if img.mode in _HIGH_DEPTH_MODES:
            img = _to_8bit_grey(img)
        if img.mode != "RGB":
            img = img.convert("RGB")
        else:
            img.load()  # a lazily opened PIL image passed by the caller may still be corrupt
    except InvalidRequestError:
        raise
    except Exception as e:
        raise InvalidRequestError(f"cannot decode image: {type(e).__name__}: {e}") from None
    return img


def _to_8bit_grey(img: Image.Image) -> Image.Image:
    """A 16-bit (I;16*, and I: how 16-bit PNGs and TIFFs also decode) or float (F) greyscale image as mode L.
    Integers scale their 16-bit range to 8 bits rounding to nearest, so v * 257 maps back to v exactly; floats
    are read in [0, 1], as float arrays are. Values outside those ranges have no one reading and are refused."""
    arr = np.asarray(img)
    if img.mode == "F":
        if not np.isfinite(arr).all() or arr.min() < 0.0 or arr.max() > 1.0:
            raise InvalidRequestError(f"float (mode F) image must hold finite values in [0, 1], got range "
                                      f"[{arr.min()}, {arr.max()}]")
        return Image.fromarray(np.rint(arr.astype(np.float64) * 255.0).astype(np.uint8))
    if arr.min() < 0 or arr.max() > 65535:
        raise InvalidRequestError(f"32-bit integer (mode I) image must hold values in [0, 65535] (16-bit), got "
                                  f"[{arr.min()}, {arr.max()}]")
    wide = arr.astype(np.uint32)
    return Image.fromarray(((wide * 255 + 32767) // 65535).astype(np.uint8))
