"""Frame sampling and video resize against transformers' own code: Qwen2VLVideoProcessor.sample_frames,
Qwen3VLVideoProcessor.sample_frames and the two video smart_resize functions, taken from the installed
transformers' source with `ast` (their modules import torchvision, which the pinned set lacks)."""

from __future__ import annotations

import ast
import importlib.util
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashvlm.processing.qwen_image import QwenImageProcessor
from flashvlm.processing.qwen_video import QwenVideoInputs, VideoSettings


def _function(module: str, name: str, cls: str | None = None):
    """A function (or a method) of a transformers module, compiled from its source alone."""
    path = Path(importlib.util.find_spec("transformers").origin).parent / "models" / module
    tree = ast.parse(path.read_text())
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    node.decorator_list = []
    namespace = {"math": math, "np": np, "torch": torch, "logger": logging.getLogger("tf"),
                 "VideoMetadata": object, "Optional": object, "Union": object}
    code = compile(ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[])), str(path), "exec")
    exec(code, namespace)  # noqa: S102 - transformers' own source, to compare against
    return namespace[name]


def _inputs(qwen3: bool) -> QwenVideoInputs:
    proc = QwenImageProcessor(patch_size=16 if qwen3 else 14, max_pixels=(32 if qwen3 else 28) ** 2 * 4096)
    return QwenVideoInputs(proc, 1, 2, 3, qwen3=qwen3)


@pytest.mark.parametrize("qwen3", [False, True])
@pytest.mark.parametrize("total,src_fps,fps,max_frames", [
    (30, 10.0, 2.0, 768), (300, 29.97, 2.0, 768), (301, 30.0, 1.0, 16), (7, 24.0, 2.0, 768), (5, 1.0, 4.0, 768),
    (1000, 25.0, 0.5, 768), (97, 12.5, 3.0, 9),
])
def test_sample_frames(qwen3: bool, total: int, src_fps: float, fps: float, max_frames: int) -> None:
    module = "qwen3_vl/video_processing_qwen3_vl.py" if qwen3 else "qwen2_vl/video_processing_qwen2_vl.py"
    cls = "Qwen3VLVideoProcessor" if qwen3 else "Qwen2VLVideoProcessor"
    sample = _function(module, "sample_frames", cls)
    this = SimpleNamespace(num_frames=None, fps=fps, temporal_patch_size=2, min_frames=4, max_frames=max_frames)
    metadata = SimpleNamespace(total_num_frames=total, fps=src_fps)
    expected = np.asarray(sample(this, metadata, fps=fps))
    settings = VideoSettings(fps=fps, min_frames=4, max_frames=max_frames, min_pixels=1, max_pixels=1)
    assert _inputs(qwen3).sample(total, src_fps, settings).tolist() == expected.tolist()


@pytest.mark.parametrize("frames,h,w,lo,hi", [
    (8, 360, 640, 128 * 32 * 32, 32 * 32 * 768), (16, 1080, 1920, 128 * 32 * 32, 32 * 32 * 768 * 4),
    (4, 64, 64, 128 * 32 * 32, 32 * 32 * 768), (3, 100, 37, 4096, 10 ** 7), (2, 20, 700, 4096, 10 ** 6),
])
def test_qwen3_video_resize(frames: int, h: int, w: int, lo: int, hi: int) -> None:
    resize = _function("qwen3_vl/video_processing_qwen3_vl.py", "smart_resize")
    settings = VideoSettings(fps=2, min_frames=4, max_frames=768, min_pixels=lo, max_pixels=hi)
    expected = resize(frames, h, w, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)
    assert _inputs(True).target_size(frames, h, w, settings) == tuple(expected)


@pytest.mark.parametrize("h,w,lo,hi", [(360, 640, 128 * 28 * 28, 28 * 28 * 768), (1080, 1920, 3136, 28 * 28 * 768),
                                       (50, 50, 128 * 28 * 28, 28 * 28 * 768), (100, 37, 3136, 10 ** 6)])
def test_qwen2_video_resize(h: int, w: int, lo: int, hi: int) -> None:
    resize = _function("qwen2_vl/video_processing_qwen2_vl.py", "smart_resize")
    settings = VideoSettings(fps=2, min_frames=4, max_frames=768, min_pixels=lo, max_pixels=hi)
    expected = resize(h, w, factor=28, min_pixels=lo, max_pixels=hi)
    assert _inputs(False).target_size(8, h, w, settings) == tuple(expected)
