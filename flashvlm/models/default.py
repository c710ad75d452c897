"""The embedded default model: the demo VLM shipped inside the package (flashvlm/demo/checkpoint), a tiny
Qwen2-VL-architecture model trained on the generated scenes of `flashvlm.demo.scenes` (docs/demo.md). It answers
questions on colour, count, relative position and printed numbers or words; nothing is downloaded or built."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "flashvlm-demo-scenes-v1"


def default_model_path() -> Path:
    path = Path(__file__).resolve().parent.parent / "demo" / "checkpoint"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the embedded demo checkpoint is missing from {path} (a broken install?)")
    return path
