"""`--video FRAMESxWIDTHxHEIGHT`: one seeded synthetic video per request of a workload (e.g. `16x640x360` on the
Qwen families), for the offline scenarios and the transformers baseline.

A video is a list of frames, which the engine takes as already sampled (all kept, at transformers' default 24 fps
for frames without metadata), so the frame count is exactly the one asked. Each request's frames are windows
sliding 8 pixels a frame over one wider picture of its own: frames differ from each other (no temporal patch
repeats) and from other requests' (no cache hit), and, being views of that picture, cost one frame's memory each
request rather than FRAMES frames'."""

from __future__ import annotations

from dataclasses import replace

from flashvlm.bench.records import BenchRequest
from flashvlm.bench.workloads import parse_image_size, synthetic_image

SHIFT = 8
"""Pixels the window slides from one frame to the next."""


def parse_video_spec(text: str) -> tuple[int, int, int]:
    """'16x640x360' -> (frames, height, width)."""
    frames, sep, size = text.strip().lower().partition("x")
    if not sep or not frames.isdigit() or int(frames) < 1:
        raise ValueError(f"--video {text!r} is not FRAMESxWIDTHxHEIGHT, e.g. 16x640x360")
    try:
        height, width = parse_image_size(size)
    except ValueError:
        raise ValueError(f"--video {text!r} is not FRAMESxWIDTHxHEIGHT, e.g. 16x640x360") from None
    return int(frames), height, width


def add_videos(requests: list[BenchRequest], spec: str, placeholder: str | None, seed: int) -> list[BenchRequest]:
    """The requests with one video each, its placeholder before the prompt's images and text. `placeholder`: the
    model family's video placeholder, None for a family without video input (ValueError)."""
    if not placeholder:
        raise ValueError("--video needs a model with video input (the Qwen-VL families)")
    frames, height, width = parse_video_spec(spec)
    out = []
    for req in requests:
        if req.prompt_token_ids is not None:
            raise ValueError("--video cannot be combined with token-id prompts")
        base = synthetic_image(f"video-s{seed}-{req.request_id}", height, width + SHIFT * (frames - 1))
        video = [base[:, SHIFT * i:SHIFT * i + width] for i in range(frames)]
        out.append(replace(req, prompt=placeholder + req.prompt, videos=[video]))
    return out
