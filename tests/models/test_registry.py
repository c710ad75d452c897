"""The family registry: each entry names its family's parts, and the loader, InputProcessor and the benchmark's
baseline reach a family only through it, so one more registry line is all a new family needs outside its files."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.models import registry
from flashvlm.models.families.qwen2_vl import QwenVLFamily
from flashvlm.models.registry import UnsupportedModelError, family_for_model_type, resolve_family
from flashvlm.processing.preprocess import get_image_processor


@pytest.mark.parametrize("architecture", registry.supported_architectures())
def test_each_entry_names_its_parts(architecture: str) -> None:
    family = resolve_family([architecture])
    assert family.architecture == architecture
    assert family_for_model_type(family.model_type) is family
    assert family.model_class().__name__ == architecture
    assert family.baseline_model_class().__name__ == architecture
    assert type(get_image_processor({}, family.model_type)) is type(family.image_processor({}))
    assert family.image_placeholder


def test_unknown_families_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="supports"):
        resolve_family(["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="model_type"):
        family_for_model_type("gpt2")


def test_a_new_family_is_one_registry_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A family registered under a new architecture name (Qwen2-VL's parts under another name) loads, takes
    images and generates, with no other edit."""
    family = QwenVLFamily("RenamedVLForConditionalGeneration", "qwen2_vl", qwen25=False)
    family.model_class = lambda: resolve_family(["Qwen2VLForConditionalGeneration"]).model_class()
    module = types.ModuleType("renamed_family")
    module.FAMILY = family
    monkeypatch.setitem(sys.modules, "renamed_family", module)
    monkeypatch.setitem(registry._FAMILIES, family.architecture, "renamed_family:FAMILY")
    path = family.build_tiny_checkpoint(tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": [family.architecture]}))

    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024)
    assert llm.engine.checkpoint.family is family
    image = np.random.default_rng(0).integers(0, 255, (56, 84, 3), dtype=np.uint8)
    out = llm.generate([{"prompt": family.image_placeholder + "hi", "images": [image]}],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
