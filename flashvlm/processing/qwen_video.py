"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL videos: frame sampling, resize, and one `MMItem` per temporal patch (two
frames), with the semantics of transformers 5.17's Qwen2VLVideoProcessor / Qwen3VLVideoProcessor and processors.

One item per temporal patch, not per video: the towers attend within a frame only (`frame_cu_seqlens`), so a
(t, h, w) video encodes as t items of (1, h, w), and every item stays within the largest image grid the memory
profile plans for; caches hold frames like images. Positions: Qwen2-VL and Qwen2.5-VL place a video's frames in
one run whose temporal axis steps by a time interval (`MMItem.frame`: the patch's index and the interval, read
by `mrope_positions`); Qwen3-VL writes each frame's timestamp as text before it, so each frame is positioned
like an image."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashvlm.processing.hashing import hash_pixels
from flashvlm.processing.preprocess import table_on, token_blocks
from flashvlm.processing.qwen_grid import largest_qwen_grid
from flashvlm.processing.qwen_image import QwenImageProcessor, smart_resize
from flashvlm.processing.resample import resize_frames
from flashvlm.processing.video import load_video
from flashvlm.pruning.base import TokenGrid
from flashvlm.pruning.temporal import (
    DEFAULT_TEMPORAL_THRESHOLD,
    TEMPORAL,
    temporal_kept,
    temporal_pruning,
    validate_temporal_threshold,
)
from flashvlm.request import InvalidRequestError, MMItem

VIDEO_KWARGS = ("fps", "max_frames", "min_frames", "video_min_pixels", "video_max_pixels", "video_pruning",
                "video_pruning_threshold")
DEFAULT_FPS = 2.0
"""Target sampling rate for a decoded file (Qwen3VLVideoProcessor's default; Qwen2-VL's processor samples
nothing by default, which for a file means every frame)."""
MAX_FRAMES = 768
"""transformers' max_frames for both processors, and the ceiling of a request's own."""


@dataclass
class VideoSettings:
    fps: float
    min_frames: int
    max_frames: int
    min_pixels: int
    max_pixels: int
    pruning: str = "none"
    """"temporal": drop tokens that repeat the previous temporal patch's (pruning/temporal.py)."""
    threshold: float = DEFAULT_TEMPORAL_THRESHOLD


@dataclass
class QwenVideoInputs:
    """Turns one `Video` into its frame items and prompt ids. `qwen3`: Qwen3-VL's sampling, total-pixel resize and
    timestamps; `tokens_per_second`: Qwen2.5-VL's time positions (None: Qwen2-VL's frame index)."""

    processor: QwenImageProcessor
    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    qwen3: bool = False
    tokens_per_second: int | None = None
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    fps: float = DEFAULT_FPS
    min_frames: int = 4
    max_frames: int = MAX_FRAMES

    @classmethod
    def for_family(cls, processor: QwenImageProcessor, cfg: Any, qwen3: bool, qwen25: bool,
                   video_config: dict | None = None) -> QwenVideoInputs:
        """`video_config`: the checkpoint's video_preprocessor_config.json, whose pixel budget (size or
        min/max_pixels), fps and min/max frames replace transformers' class defaults."""
        text = getattr(cfg, "text_config", cfg)
        vc = video_config or {}

        def token(name: str) -> int:
            value = getattr(cfg, name, None)
            return int(value if value is not None else getattr(text, name))

        factor = processor.factor
        # transformers' class defaults (Qwen3-VL: over the whole clip), kept within the largest planned image.
        lo, hi = (128 * factor ** 2, factor ** 2 * 768)
        size = vc.get("size") or {}
        lo = int(vc.get("min_pixels") or size.get("shortest_edge") or lo)
        hi = int(vc.get("max_pixels") or size.get("longest_edge") or hi)
        ceiling = max(processor.max_pixels, processor.max_pixels_limit or 0)
        if not qwen3:
            hi = min(hi, ceiling)
        return cls(processor, token("video_token_id"), token("vision_start_token_id"), token("vision_end_token_id"),
                   qwen3=qwen3, tokens_per_second=int(cfg.vision_config.tokens_per_second) if qwen25 else None,
                   min_pixels=min(lo, hi), max_pixels=hi, fps=float(vc.get("fps") or DEFAULT_FPS),
                   min_frames=int(vc.get("min_frames") or 4), max_frames=min(int(vc.get("max_frames") or MAX_FRAMES),
                                                                             MAX_FRAMES))

    # ---- options -------------------------------------------------------------------------------
    def settings(self, kwargs: dict) -> VideoSettings:
        def number(name: str, default: Any, kind: type) -> Any:
            v = kwargs.get(name, default)
            if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int) or v <= 0:
                raise InvalidRequestError(f"{name} must be a positive {kind.__name__}, got {v!r}")
            return v

        s = VideoSettings(float(number("fps", self.fps, float)), number("min_frames", self.min_frames, int),
                          number("max_frames", self.max_frames, int), number("video_min_pixels", self.min_pixels, int),
                          number("video_max_pixels", self.max_pixels, int))
        s.pruning = kwargs.get("video_pruning", "none")
        if s.pruning not in ("none", TEMPORAL):
            raise InvalidRequestError(f"video_pruning must be 'none' or '{TEMPORAL}', got {s.pruning!r}")
        try:
            s.threshold = validate_temporal_threshold(kwargs.get("video_pruning_threshold",
                                                                 DEFAULT_TEMPORAL_THRESHOLD))
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if s.max_frames > MAX_FRAMES:
            raise InvalidRequestError(f"max_frames={s.max_frames} exceeds the limit of {MAX_FRAMES}")
        if s.min_frames > s.max_frames or s.min_pixels > s.max_pixels:
            raise InvalidRequestError("min_frames must be <= max_frames and video_min_pixels <= video_max_pixels")
        if s.max_pixels > self.max_pixels and not self.qwen3:
            raise InvalidRequestError(f"video_max_pixels={s.max_pixels} exceeds the limit of {self.max_pixels}")
        return s

    # ---- sampling and resize -------------------------------------------------------------------
    def sample(self, total: int, fps: float, s: VideoSettings) -> np.ndarray:
        """Indices of the frames a file of `total` frames at `fps` keeps."""
        if self.qwen3:  # Qwen3VLVideoProcessor.sample_frames
            n = min(max(int(total / fps * s.fps), s.min_frames), s.max_frames, total)
            return np.linspace(0, total - 1, n).round().astype(int)
        t = self.processor.temporal_patch_size  # Qwen2VLVideoProcessor.sample_frames
        most = math.floor(min(s.max_frames, total) / t) * t
        n = math.floor(min(max(total / fps * s.fps, s.min_frames), most, total) / t) * t
        if n <= 0:
            return np.arange(total)
        return torch.arange(0, total, total / n).int().numpy()

    def target_size(self, num_frames: int, height: int, width: int, s: VideoSettings) -> tuple[int, int]:
        factor = self.processor.factor
        if not self.qwen3:
            target = smart_resize(height, width, factor, s.min_pixels, s.max_pixels)
        else:  # Qwen3-VL's smart_resize: the pixel budget covers every frame
            if height < factor or width < factor:
                scale = max(factor / height, factor / width)
                height, width = int(height * scale), int(width * scale)
            t = self.processor.temporal_patch_size
            h, w = round(height / factor) * factor, round(width / factor) * factor
            frames = round(num_frames / t) * t
            if frames * h * w > s.max_pixels:
                beta = math.sqrt(num_frames * height * width / s.max_pixels)
                h = max(factor, math.floor(height / beta / factor) * factor)
                w = max(factor, math.floor(width / beta / factor) * factor)
            elif frames * h * w < s.min_pixels:
                beta = math.sqrt(s.min_pixels / (num_frames * height * width))
                h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
            target = (h, w)
        _, grid_h, grid_w = largest_qwen_grid(self.processor)
        patch = self.processor.patch_size
        if target[0] * target[1] > grid_h * grid_w * patch ** 2:
            raise InvalidRequestError(f"video frames {width}x{height} would be resized to {target[1]}x{target[0]}, "
                                      "more than the largest image memory was planned for; lower video_max_pixels")
        return target

    # ---- items ---------------------------------------------------------------------------------
    def make_items(self, src: Any, kwargs: dict, tokenizer: Any) -> tuple[list[MMItem], list[int]]:
        """(the video's frame items, each with its offset within the expansion; what its one placeholder token
        becomes: Qwen2/2.5-VL's run of video tokens, Qwen3-VL's ``<t seconds><|vision_start|>tokens<|vision_end|>``
        per temporal patch, inside the template's own vision_start/vision_end as transformers writes it)."""
        s = self.settings(kwargs)
        video = load_video(src, lambda total, fps: self.sample(total, fps, s))
        if video.given_as_frames and video.total > s.max_frames:
            raise InvalidRequestError(f"{video.total} frames given; max_frames is {s.max_frames}")
        frames, indices = video.frames, video.indices
        n, height, width, _ = frames.shape
        h, w = self.target_size(n, height, width, s)
        proc, t = self.processor, self.processor.temporal_patch_size
        sampled_fps = video.fps if video.given_as_frames else len(indices) / video.total * video.fps
        interval = 1 if self.tokens_per_second is None else self.tokens_per_second * int(t / sampled_fps)
        params = {**proc.processor_params(), "video": True, "frames": n, "min_pixels": s.min_pixels,
                  "max_pixels": s.max_pixels, "interval": interval, "qwen3": self.qwen3, "fps": video.fps,
                  "indices": indices.tolist()}
        video_hash = hash_pixels("RGB", width, height, params, np.ascontiguousarray(frames))
        if (h, w) != (height, width):
            frames = resize_frames(frames, h, w, proc.resample)
        if pad := -n % t:
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        times = self._timestamps(indices, video.fps)
        grid = (1, h // proc.patch_size, w // proc.patch_size)
        items: list[MMItem] = []
        ids: list[int] = []
        merged = TokenGrid.from_patch_grid(grid, proc.merge_size)
        previous = None
        for k in range(len(frames) // t):
            if self.qwen3:
                ids += tokenizer.encode(f"<{times[k]:.1f} seconds>", add_special_tokens=False) + [self.vision_start_id]
            pixels = torch.from_numpy(np.ascontiguousarray(frames[k * t:(k + 1) * t]))
            item = MMItem(mm_hash=f"{video_hash}:{k}", pixel_values=pixels, offset=len(ids),
                          num_tokens=proc.num_image_tokens(grid), layout=grid,
                          frame=None if self.qwen3 else (k, interval),
                          image_size=(width, height), pixel_decoder=self.decode_compact)
            if s.pruning == TEMPORAL:
                blocks = torch.cat([token_blocks(frame, proc.factor) for frame in pixels], dim=1)
                kept = None if previous is None else temporal_kept(previous, blocks, s.threshold)
                if kept is not None:
                    item.pruning = temporal_pruning(merged, s.threshold, kept)
                    item.num_tokens = len(kept)
                previous = blocks
            items.append(item)
            ids += [self.video_token_id] * item.num_tokens
            if self.qwen3:
                ids.append(self.vision_end_id)
        return items, ids

    def baseline_inputs(self, items: list[MMItem], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        image_token_id: int, device: str) -> dict[str, torch.Tensor]:
        """The video arguments of the transformers model's `generate` for a batch's frame items, in order (the
        benchmark's baseline): pixel_values_videos, video_grid_thw (Qwen2/2.5-VL: one row per video, a video
        starting at its patch 0; Qwen3-VL: one per temporal patch, as its position rule splits them anyway),
        Qwen2.5-VL's second_per_grid_ts (the items' time step, so its positions equal ours), and mm_token_type_ids
        marking image (1) and video (2) tokens, which replaces the images'."""
        grids: list[list[int]] = []
        steps: list[float] = []
        for item in items:
            if item.frame is None or item.frame[0] == 0:
                grids.append([0, *item.layout[1:]])
                if item.frame is not None and self.tokens_per_second is not None:
                    steps.append(item.frame[1] / self.tokens_per_second)
            grids[-1][0] += 1
        live = attention_mask == 1
        out = {"pixel_values_videos": torch.cat([it.model_pixels(device) for it in items]),
               "video_grid_thw": torch.tensor(grids, device=device),
               "mm_token_type_ids": (((input_ids == image_token_id) & live).long()
                                     + 2 * ((input_ids == self.video_token_id) & live).long()).to(device)}
        if self.tokens_per_second is not None:
            out["second_per_grid_ts"] = torch.tensor(steps, device=device)
        return out

    def _timestamps(self, indices: np.ndarray, fps: float) -> list[float]:
        """Qwen3VLProcessor._calculate_timestamps: the mean time of each temporal patch's first and last frame."""
        t = self.processor.temporal_patch_size
        idx = list(indices.tolist())
        idx += [idx[-1]] * (-len(idx) % t)
        return [(idx[i] / fps + idx[i + t - 1] / fps) / 2 for i in range(0, len(idx), t)]

    def decode_compact(self, x: torch.Tensor) -> torch.Tensor:
        """uint8 (T, H, W, C) frames -> float32 (patches, C*T*P*P): rows merge window by merge window, each laid out
        (C, T, P, P) as the Conv3d patch embedding reads it, normalized by the image processor's value table."""
        proc = self.processor
        t, h, w, c = x.shape
        p, m = proc.patch_size, proc.merge_size
        gh, gw = h // p, w // p
        rows = x.reshape(t, gh // m, m, p, gw // m, m, p, c).permute(1, 4, 2, 5, 7, 0, 3, 6).reshape(gh * gw, -1)
        per_channel = t * p * p
        offsets = torch.arange(0, 256 * c, 256, dtype=torch.int32, device=x.device).repeat_interleave(per_channel)
        values = torch.index_select(table_on(proc, x.device), 0, (rows.to(torch.int32) + offsets).reshape(-1))
        return values.view(gh * gw, c * per_channel)
