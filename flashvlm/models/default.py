"""The embedded default model: a tiny Qwen2-VL-architecture checkpoint with seeded random weights,
built on first use into a local cache folder (no download). Its answers are random text until a
trained demo checkpoint replaces it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "flashvlm-tiny-qwen2-vl-random-v1"


def cache_dir() -> Path:
    return Path(os.environ.get("FLASHVLM_CACHE", Path.home() / ".cache" / "flashvlm"))


def default_model_path() -> Path:
    path = cache_dir() / DEFAULT_MODEL_NAME
    if (path / "config.json").is_file():
        return path
    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so a concurrent or interrupted build never leaves half a folder.
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=path.parent))
    try:
        build_qwen2_vl(tmp, seed=1234, hidden=128, layers=4, vision_depth=4,
                       min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 256)
        try:
            tmp.rename(path)
        except OSError:  # another process won the race
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
