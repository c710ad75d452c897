"""Maps `config.architectures` to model classes, imported lazily so unused families cost nothing."""

from __future__ import annotations

import importlib

from flashvlm.models.interfaces import VLModel

_MODELS: dict[str, tuple[str, str]] = {
    "Qwen2VLForConditionalGeneration": ("flashvlm.models.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("flashvlm.models.qwen2_vl", "Qwen2_5_VLForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("flashvlm.models.llava", "LlavaForConditionalGeneration"),
}


class UnsupportedModelError(ValueError):
    pass


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[VLModel]:
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise UnsupportedModelError(
        f"unsupported architecture {architectures}; flashvlm supports: {', '.join(supported_architectures())}")
