"""Load request videos into uint8 RGB frames: a file path (or ``file://``), raw bytes, a ``data:video/...;base64`` URI
(decoded with PyAV, the optional ``video`` extra), or a list of frames already sampled (PIL images or arrays).

PyAV: one wheel with its own FFmpeg, no torch build to match; it decodes a 30-frame 64x64 clip in 4-70 ms on a busy
2-core host (tests/e2e/test_video.py prints it). torchcodec could not be measured against it: its PyPI wheel
(0.17, with CPU torch 2.13) installs but fails to import, as it links CUDA's libnvrtc.so.13 and loads the system's
FFmpeg shared libraries (libavcodec 4-9), which a plain Python host lacks; PyAV needs neither, so it stays.

A file is read twice: its packets are counted, the sampler picks frame indices from that count and the stream's
rate, and only the picked frames are kept while decoding, so memory follows the sampled frames, not the file's.
Every failure raises ``InvalidRequestError``, so the server answers 400 and other requests carry on."""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashvlm.processing.images import load_image, rgb_array
from flashvlm.request import InvalidRequestError

MAX_VIDEO_FILE_BYTES = 256 * 2**20
MAX_DECODED_FRAMES = 100_000
"""Frames a file may hold (counted from its packets, before any is decoded)."""
MAX_SAMPLED_BYTES = 2 << 30
"""RGB bytes of the sampled frames at their source size, before the resize."""
DEFAULT_FRAMES_FPS = 24.0
"""The rate transformers' video processors assume for frames given without metadata (VideoMetadata.sampled_fps):
it sets Qwen2.5-VL's time positions and Qwen3-VL's timestamps for a list of frames."""


Sampler = Callable[[int, float], np.ndarray]
"""(frames in the file, its fps) -> the sorted indices of the frames to keep."""


@dataclass
class Video:
    """The kept frames (N, H, W, 3) uint8, their `indices` among the source's `total`, the source's frame rate;
    `given_as_frames` for a list of frames (taken as already sampled: all are kept)."""

    frames: np.ndarray
    fps: float
    indices: np.ndarray
    total: int
    given_as_frames: bool


def load_video(src: Any, sample: Sampler) -> Video:
    if isinstance(src, (list, tuple)):
        return _from_frames(src)
    if isinstance(src, (bytes, bytearray, memoryview)):
        return _decode(bytes(src), "video bytes", sample)
    if isinstance(src, os.PathLike):
        return _decode(_read(Path(src)), f"video file {str(src)!r}", sample)
    if isinstance(src, str):
        if src.startswith("data:"):
            return _decode(_data_uri(src), "data URI video", sample)
        if src.startswith(("http://", "https://")):
            raise InvalidRequestError("remote video URLs are not fetched; send a data URI or bytes")
        path = src[len("file://"):] if src.startswith("file://") else src
        if not path:
            raise InvalidRequestError("empty string given as a video source")
        return _decode(_read(Path(path)), f"video file {path!r}", sample)
    raise InvalidRequestError(f"unsupported video source type {type(src).__name__}: give a file path, bytes, a "
                              "data:video/...;base64 URI or a list of frames")


def _from_frames(frames: list | tuple) -> Video:
    if not frames:
        raise InvalidRequestError("a video given as frames needs at least one frame")
    if len(frames) > MAX_DECODED_FRAMES:
        raise InvalidRequestError(f"{len(frames)} frames; the limit is {MAX_DECODED_FRAMES}")
    arrays = []
    for i, frame in enumerate(frames):
        if isinstance(frame, (str, bytes, os.PathLike)):
            raise InvalidRequestError(f"frame {i}: a frame must be a PIL image or an array")
        try:
            # An RGB array is kept as it is (load_image's pixels without its PIL round trip); np.stack copies it.
            rgb = rgb_array(frame)
            arrays.append(rgb if rgb is not None else np.asarray(load_image(frame), dtype=np.uint8))
        except InvalidRequestError as e:
            raise InvalidRequestError(f"frame {i}: {e}") from None
    if len({a.shape for a in arrays}) > 1:
        raise InvalidRequestError(f"the frames of a video must share one size, got {sorted({a.shape for a in arrays})}")
    frames = np.stack(arrays)
    return Video(frames, DEFAULT_FRAMES_FPS, np.arange(len(frames)), len(frames), given_as_frames=True)


def _read(path: Path) -> bytes:
    try:
        if not path.is_file():
            raise InvalidRequestError(f"video path is not a regular file: {str(path)[:200]!r}")
        if path.stat().st_size > MAX_VIDEO_FILE_BYTES:
            raise InvalidRequestError(f"video file {str(path)!r} is over {MAX_VIDEO_FILE_BYTES} bytes")
        return path.read_bytes()
    except PermissionError:
        raise InvalidRequestError(f"permission denied reading video file: {str(path)!r}") from None
    except OSError as e:
        raise InvalidRequestError(f"cannot read video file {str(path)[:200]!r}: {e.strerror or e}") from None


def _data_uri(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    media = header[len("data:"):].split(";")
    if not sep or "base64" not in media[1:]:
        raise InvalidRequestError("a video data URI must be data:video/...;base64,<data>")
    if media[0] and not media[0].startswith("video/"):
        raise InvalidRequestError(f"video data URI media type must be video/*, got {media[0]!r}")
    try:
        data = base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequestError(f"invalid base64 in video data URI: {e}") from None
    if not data:
        raise InvalidRequestError("video data URI holds no data")
    return data


def _decode(data: bytes, what: str, sample: Sampler) -> Video:
    av = _pyav()
    if not data:
        raise InvalidRequestError(f"{what} is empty")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise InvalidRequestError(f"{what} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else DEFAULT_FRAMES_FPS
            total = 0
            for packet in container.demux(stream):
                total += packet.size > 0
                if total > MAX_DECODED_FRAMES:
                    raise InvalidRequestError(f"{what} has over {MAX_DECODED_FRAMES} frames")
        if total == 0:
            raise InvalidRequestError(f"{what} holds no frame")
        indices = sample(total, fps)
        if len(indices) * stream.width * stream.height * 3 > MAX_SAMPLED_BYTES:
            raise InvalidRequestError(f"{what}: {len(indices)} frames of {stream.width}x{stream.height} are over "
                                      f"{MAX_SAMPLED_BYTES >> 20} MiB; lower max_frames or fps")
        wanted, frames, index = set(indices.tolist()), [], 0
        with av.open(io.BytesIO(data), mode="r") as container:
            for frame in container.decode(container.streams.video[0]):
                if index in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
                index += 1
    except InvalidRequestError:
        raise
    except (av.FFmpegError, ValueError, OSError) as e:
        raise InvalidRequestError(f"cannot decode {what}: {e}") from None
    if len(frames) != len(indices):  # packets that decode to no frame (or more than one)
        raise InvalidRequestError(f"{what}: {index} frames decoded where {total} packets were counted")
    return Video(np.stack(frames), fps, np.asarray(indices), total, given_as_frames=False)


def _pyav():
    try:
        import av
    except ImportError:
        raise InvalidRequestError("decoding a video file needs PyAV: pip install 'flashvlm[video]' (a list of "
                                  "frames needs no decoder)") from None
    return av
