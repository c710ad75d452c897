"""The embedded default model: the demo VLM shipped inside the package (flashvlm/demo/checkpoint), a tiny
Qwen2-VL-architecture model trained on the generated scenes of `flashvlm.demo.scenes` (docs/demo.md). It answers
questions on colour, count, relative position and printed numbers or words; nothing is downloaded or built.

The demo models also have names `--model` (and `LLM(model)`) take: `demo` (the embedded one) and `demo-large`
(448x448 scenes, 256 image tokens a picture, shipped beside it in flashvlm/demo/checkpoint-large; docs/demo.md)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "flashvlm-demo-scenes-v1"
# name -> checkpoint folder under flashvlm/demo; the names are flashvlm.demo.variants' (a test checks they agree)
DEMO_MODEL_FOLDERS = {"demo": "checkpoint", "demo-large": "checkpoint-large"}
_DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"


def demo_model_dir(name: str) -> Path:
    """Where the demo model `name` lives; no check that it is there."""
    return _DEMO_DIR / DEMO_MODEL_FOLDERS[name]


def default_model_path() -> Path:
    path = demo_model_dir("demo")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the embedded demo checkpoint is missing from {path} (a broken install?)")
    return path


def resolve_model(model: str | None) -> str:
    """The checkpoint folder `model` names: None or "demo" is the embedded model, "demo-large" its large sibling;
    anything else is a path, returned as given. A folder of one of those names in the working directory wins
    (a user's own checkpoint is never shadowed). A demo model whose folder is missing (an install without it) is a
    FileNotFoundError saying how to train it."""
    if model is None:
        return str(default_model_path())
    if model not in DEMO_MODEL_FOLDERS or Path(model).exists():
        return model
    if model == "demo":
        return str(default_model_path())
    path = demo_model_dir(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"the {model} demo model is not trained yet (no checkpoint in {path}); train it (about 6 minutes on "
            f"one H200) with: python -m flashvlm.demo.train --variant {model} --out {path}  (docs/demo.md)")
    return str(path)
