"""Where request images and videos may come from, and how big they may be.

Policy (all limits are server flags):
- `data:image/...;base64,...` URIs are always accepted, up to `max_image_bytes` decoded bytes (videos:
  `data:video/...`, up to `max_video_bytes`, the limit of a local video file too);
- local files (a path or a `file://` URL) only under `--allowed-local-media-path` (resolved, so `..` and
  symlinks cannot leave it); without that flag every path is refused (403);
- `http(s)://` URLs only with `--allow-remote-images`, fetched with a timeout and a byte cap;
- at most `limit_images` images per prompt; each at most `max_image_pixels` pixels, read from the image header
  before any pixel is decoded;
- per request, at most `max_request_pixels` pixels over all its images (from the headers, before any is decoded)
  and `max_request_decode_s` worker seconds decoding and resizing them (flashvlm/processing/prompt_pipeline.py).

Everything is turned into bytes here, so the engine only ever decodes bytes it was handed.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from PIL import Image

from flashvlm.processing.prompt_pipeline import ImageBudget
from flashvlm.request import InvalidRequestError
from flashvlm.server.limits import (
    DEFAULT_LIMIT_IMAGES,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_REQUEST_DECODE_S,
    DEFAULT_MAX_REQUEST_PIXELS,
    DEFAULT_MAX_VIDEO_BYTES,
)
from flashvlm.server.protocol import APIError, bad_request

_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_EXAMPLE_MIME = {"image": "image/png", "video": "video/mp4"}


@dataclass
class MediaPolicy:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    limit_images: int = DEFAULT_LIMIT_IMAGES
    allowed_local_media_path: Path | None = None
    allow_remote_images: bool = False
    remote_timeout_s: float = 10.0
    max_request_pixels: int = DEFAULT_MAX_REQUEST_PIXELS
    max_request_decode_s: float = DEFAULT_MAX_REQUEST_DECODE_S
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES

    def __post_init__(self) -> None:
        if self.allowed_local_media_path is not None:
            self.allowed_local_media_path = Path(self.allowed_local_media_path).resolve()
        if self.max_request_pixels < 1:
            raise ValueError(f"--max-request-image-pixels must be >= 1, got {self.max_request_pixels}")
        if self.max_video_bytes < 1:
            raise ValueError(f"--max-video-bytes must be >= 1, got {self.max_video_bytes}")
        if self.max_request_decode_s <= 0:
            raise ValueError(f"--max-request-decode-seconds must be positive, got {self.max_request_decode_s}")

    def image_budget(self) -> ImageBudget:
        return ImageBudget(self.max_request_pixels, self.max_request_decode_s)


BUDGET_FLAGS = {"max_pixels": "--max-request-image-pixels", "max_decode_s": "--max-request-decode-seconds"}
"""The server flag behind each ImageBudget field, for the refusal's message."""


def parse_limit_mm_per_prompt(value: str) -> int:
    """`image=4`, `{"image": 4}` (vLLM's two spellings) or a bare `4` -> images per prompt."""
    import json

    text = value.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--limit-mm-per-prompt: invalid JSON {value!r}: {e}") from None
    elif "=" in text:
        data = dict(item.split("=", 1) for item in text.split(","))
    else:
        data = {"image": text}
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"--limit-mm-per-prompt: only 'image' is supported, got {sorted(unknown)}")
    try:
        limit = int(data.get("image", DEFAULT_LIMIT_IMAGES))
    except (TypeError, ValueError):
        raise ValueError(f"--limit-mm-per-prompt: image limit must be an integer, got {value!r}") from None
    if limit < 0:
        raise ValueError("--limit-mm-per-prompt: image limit must be >= 0")
    return limit


def image_parts(messages: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
    """(part, url) for every image_url part, in order; the part dicts are the ones to rewrite."""
    found = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    url = part["image_url"]
                    found.append((part, url["url"] if isinstance(url, dict) else url))
    return found


def video_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every video_url part, in order (the dicts to rewrite)."""
    return [part for msg in messages if isinstance(msg.get("content"), list)
            for part in msg["content"] if part.get("type") == "video_url"]


def set_video_source(part: dict[str, Any], policy: MediaPolicy, index: int) -> None:
    """Rewrite a video_url part in place into a `video` part holding its bytes: a data URI's or a local file's under
    the allowed media path, within `max_video_bytes`; remote videos are not fetched. Blocking: off the event loop."""
    url = part["video_url"]["url"] if isinstance(part["video_url"], dict) else part["video_url"]
    if not isinstance(url, str):
        raise bad_request(f"video {index}: video_url.url must be a string", "messages", "invalid_video_url")
    if is_remote(url):
        raise bad_request(f"video {index}: remote video URLs are not fetched; send a data URI", "messages",
                          "invalid_video_url")
    if _SCHEME_RE.match(url) and not url.startswith("file://"):
        raise bad_request(f"video {index}: unsupported URL scheme in {url[:40]!r}; send a data URI", "messages",
                          "invalid_video_url")
    data = _decode_data_uri(url, policy, index, "video") if url.startswith("data:") else _read_local(
        url, policy, index, "video")
    part.clear()
    part.update({"type": "video", "video": data})


def check_image_count(num_images: int, policy: MediaPolicy) -> None:
    if num_images > policy.limit_images:
        raise bad_request(f"{num_images} images in one prompt; at most {policy.limit_images} are allowed "
                          "(--limit-mm-per-prompt)", "messages", "too_many_images")


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def set_image_bytes(part: dict[str, Any], data: bytes) -> None:
    """Rewrite an image_url part in place into an `image` part holding the bytes (what the engine decodes)."""
    part.clear()
    part.update({"type": "image", "image": data})


def load_source(src: Any, index: int, policy: MediaPolicy) -> bytes:
    """An image source of a chat request (its URL, or the bytes fetched from a remote one) as checked bytes.
    Blocking: runs on the image pool."""
    if isinstance(src, (bytes, bytearray)):
        check_pixels(bytes(src), policy, index)
        return bytes(src)
    return load_image_bytes(src, policy, index)


def load_image_bytes(url: str, policy: MediaPolicy, index: int) -> bytes:
    """Bytes of a data URI or an allowed local file, with the byte and pixel limits checked. Blocking (file
    reads): call off the event loop."""
    if url.startswith("data:"):
        data = _decode_data_uri(url, policy, index)
    elif is_remote(url):
        raise AssertionError("remote images are fetched by fetch_remote_image")
    elif _SCHEME_RE.match(url) and not url.startswith("file://"):
        raise bad_request(f"image {index}: unsupported URL scheme in {url[:40]!r}; send a data URI", "messages",
                          "invalid_image_url")
    else:
        data = _read_local(url, policy, index)
    check_pixels(data, policy, index)
    return data


async def fetch_remote_image(url: str, policy: MediaPolicy, index: int) -> bytes:
    if not policy.allow_remote_images:
        raise bad_request(f"image {index}: http(s) image URLs are disabled on this server (--allow-remote-images); "
                          "send the image as a data URI", "messages", "remote_images_disabled")
    import httpx

    limit = policy.max_image_bytes
    try:
        async with httpx.AsyncClient(timeout=policy.remote_timeout_s, follow_redirects=True,
                                     max_redirects=3) as client, client.stream("GET", url) as resp:
            if resp.status_code != 200:
                raise bad_request(f"image {index}: fetching {url[:200]!r} gave HTTP {resp.status_code}", "messages",
                                  "invalid_image_url")
            declared = resp.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _too_big(index, int(declared), limit)
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > limit:
                    raise _too_big(index, len(buf), limit)
    except httpx.HTTPError as e:
        raise bad_request(f"image {index}: fetching {url[:200]!r} failed: {type(e).__name__}: {e}", "messages",
                          "invalid_image_url") from None
    return bytes(buf)


def check_pixels(data: bytes, policy: MediaPolicy, index: int) -> None:
    """Refuse an image over the pixel limit from its header alone (no pixel is decoded here)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                width, height = img.size
    except Image.DecompressionBombError:
        raise _too_many_pixels(index, None, policy.max_image_pixels) from None
    except Exception:
        raise InvalidRequestError(f"image {index}: cannot decode the image: corrupt or not an image in a "
                                  f"supported format ({len(data)} bytes)") from None
    if width * height > policy.max_image_pixels:
        raise _too_many_pixels(index, (width, height), policy.max_image_pixels)


def _too_big(index: int, size: int, limit: int, kind: str = "image") -> APIError:
    return bad_request(f"{kind} {index} is {size} bytes; the limit is {limit} bytes (--max-{kind}-bytes)",
                       "messages", f"{kind}_too_large")


def _byte_limit(policy: MediaPolicy, kind: str) -> int:
    return policy.max_video_bytes if kind == "video" else policy.max_image_bytes


def _too_many_pixels(index: int, size: tuple[int, int] | None, limit: int) -> APIError:
    what = f"{size[0]}x{size[1]} = {size[0] * size[1]} pixels" if size else "a decompression bomb"
    return bad_request(f"image {index} is {what}; the limit is {limit} pixels (--max-image-pixels)", "messages",
                       "image_too_large")


def _decode_data_uri(url: str, policy: MediaPolicy, index: int, kind: str = "image") -> bytes:
    limit = _byte_limit(policy, kind)
    header, sep, payload = url.partition(",")
    media = header[len("data:"):].split(";")
    if not sep or "base64" not in media[1:]:
        raise bad_request(f"{kind} {index}: a data URI must look like data:{_EXAMPLE_MIME[kind]};base64,<data>",
                          "messages", f"invalid_{kind}_url")
    if media[0] and not media[0].startswith(f"{kind}/"):
        raise bad_request(f"{kind} {index}: data URI media type must be {kind}/*, got {media[0][:40]!r}", "messages",
                          f"invalid_{kind}_url")
    payload = "".join(payload.split())  # clients wrap long base64 lines
    # Checked before decoding, so an oversized upload costs no decode: 4 base64 chars carry 3 bytes.
    approx = len(payload) * 3 // 4 - payload[-2:].count("=")
    if approx > limit:
        raise _too_big(index, approx, limit, kind)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        try:  # the URL-safe alphabet some clients use
            data = base64.b64decode(payload, altchars=b"-_", validate=True)
        except (binascii.Error, ValueError) as e:
            raise bad_request(f"{kind} {index}: invalid base64 in the data URI: {e}", "messages",
                              "invalid_base64") from None
    if not data:
        raise bad_request(f"{kind} {index}: the data URI holds no data", "messages", f"invalid_{kind}_url")
    return data


def _read_local(url: str, policy: MediaPolicy, index: int, kind: str = "image") -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise APIError(403, f"{kind} {index}: local file paths are not allowed on this server; send a data URI "
                       "(or start the server with --allowed-local-media-path DIR)", "permission_error", "messages",
                       "local_media_not_allowed")
    raw = unquote(urlparse(url).path) if url.startswith("file://") else url
    if not raw or "\x00" in raw:
        raise bad_request(f"{kind} {index}: empty or invalid file path", "messages", f"invalid_{kind}_url")
    path = Path(raw)
    try:
        # resolve() follows symlinks and '..', so the containment test sees where the bytes really are.
        resolved = (path if path.is_absolute() else root / path).resolve()
    except (OSError, RuntimeError) as e:
        raise bad_request(f"{kind} {index}: invalid file path: {e}", "messages", f"invalid_{kind}_url") from None
    if not resolved.is_relative_to(root):
        raise APIError(403, f"{kind} {index}: {raw[:200]!r} is outside the allowed media directory", "permission_error",
                       "messages", "local_media_not_allowed")
    try:
        size = resolved.stat().st_size
        if not resolved.is_file():
            raise bad_request(f"{kind} {index}: {raw[:200]!r} is not a file", "messages", f"invalid_{kind}_url")
        if size > _byte_limit(policy, kind):
            raise _too_big(index, size, _byte_limit(policy, kind), kind)
        return resolved.read_bytes()
    except FileNotFoundError:
        raise bad_request(f"{kind} {index}: file not found: {raw[:200]!r}", "messages", f"invalid_{kind}_url") from None
    except OSError as e:
        raise bad_request(f"{kind} {index}: cannot read {raw[:200]!r}: {e.strerror or e}", "messages",
                          f"invalid_{kind}_url") from None
