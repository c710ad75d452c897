"""The model families flashvlm serves, one line each, and what a family provides (`ModelFamily`).

A family is imported on first use, so unused families cost nothing; its entry object names every part of it:
the model class (with its vision tower and checkpoint weight-name mapping), the image part of `InputProcessor`,
the checks a checkpoint must pass at load, the transformers class the benchmark compares against, and the tiny
checkpoint builder the tests use. Nothing outside the family's own files branches on which family it is."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from flashvlm.models.interfaces import VLModel
    from flashvlm.models.loader import Checkpoint
    from flashvlm.processing.preprocess import ImageInputs
    from flashvlm.request import MMItem

_FAMILIES: dict[str, str] = {
    # config.architectures entry -> "module:object", the family's ModelFamily
    "Qwen2VLForConditionalGeneration": "flashvlm.models.families.qwen2_vl:QWEN2_VL",
    "Qwen2_5_VLForConditionalGeneration": "flashvlm.models.families.qwen2_vl:QWEN2_5_VL",
    "LlavaForConditionalGeneration": "flashvlm.models.families.llava:LLAVA",
    "LlavaNextForConditionalGeneration": "flashvlm.models.families.llava_next:LLAVA_NEXT",
    "Qwen3VLForConditionalGeneration": "flashvlm.models.families.qwen3_vl:QWEN3_VL",
    "FuyuForCausalLM": "flashvlm.models.families.fuyu:FUYU",
}


class UnsupportedModelError(ValueError):
    pass


class ModelFamily:
    """One model family. An instance names its parts (the constructor's arguments; modules as import paths, each
    imported on first use) and subclasses implement the methods; heavy imports (the model, torch, transformers)
    stay inside the methods."""

    architecture: str
    """The `config.architectures` entry of its checkpoints (also the transformers class name)."""
    model_type: str
    """`config.model_type` of its checkpoints."""
    image_placeholder: str
    """The text a raw (untemplated) prompt writes for one image, as the benchmark's workloads do."""
    video_placeholder: str | None
    """The same for one video; None: the family takes no video input."""
    model_module: str
    """The module defining the model class, which is named `architecture` as in transformers."""
    image_processor_ref: str
    """"module:object" of the image processor class, built with its `from_config`."""
    tiny_checkpoint_ref: str
    """"module:object" of the tiny checkpoint builder, called with the folder and keywords."""

    def __init__(self, architecture: str, model_type: str, image_placeholder: str, *, model_module: str,
                 image_processor: str, tiny_checkpoint: str, video_placeholder: str | None = None) -> None:
        self.architecture, self.model_type = architecture, model_type
        self.image_placeholder, self.video_placeholder = image_placeholder, video_placeholder
        self.model_module, self.image_processor_ref, self.tiny_checkpoint_ref = (model_module, image_processor,
                                                                                 tiny_checkpoint)

    def model_class(self) -> type[VLModel]:
        return import_ref(f"{self.model_module}:{self.architecture}")

    def image_processor(self, preprocessor_config: Mapping[str, Any]) -> Any:
        """The image processor built from a preprocessor_config.json dict; a bad config raises ValueError."""
        return import_ref(self.image_processor_ref).from_config(preprocessor_config)

    def image_inputs(self, checkpoint: Checkpoint) -> ImageInputs:
        """The image part of `InputProcessor` for this checkpoint."""
        raise NotImplementedError

    def video_inputs(self, checkpoint: Checkpoint) -> Any:
        """The family's video part (one video to its frame items and prompt ids), or None: no video input."""
        return None

    def check_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Refuse (ConfigError) a checkpoint whose parts do not fit together; most families have nothing to check."""

    def vision_patches(self, item: MMItem) -> int:
        """Patches the vision tower runs for this item (the benchmark's prefill floor)."""
        raise NotImplementedError

    def baseline_model_class(self) -> type:
        """The transformers class of this family, for the benchmark's baseline."""
        import transformers

        return getattr(transformers, self.architecture)

    def baseline_image_inputs(self, items: list[MMItem], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              image_token_id: int, device: str) -> dict[str, torch.Tensor]:
        """The image arguments of the transformers model's `generate` for a batch's items (pixels in float32; the
        baseline casts every floating tensor). By default pixel_values, the items' (channels, height, width) images
        stacked, as transformers' models of one fixed image size take them."""
        import torch

        return {"pixel_values": torch.stack([it.model_pixels(device) for it in items])}

    def build_tiny_checkpoint(self, path: str | Path, **kwargs: Any) -> Path:
        """A tiny checkpoint folder with seeded random weights, written through transformers (tests, the demo)."""
        return import_ref(self.tiny_checkpoint_ref)(path, **kwargs)


def import_ref(ref: str) -> Any:
    """The object a "module:object" reference names, its module imported now."""
    module_name, attr = ref.split(":")
    return getattr(importlib.import_module(module_name), attr)


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


@functools.cache
def _load(architecture: str) -> ModelFamily:
    return import_ref(_FAMILIES[architecture])


def resolve_family(architectures: list[str] | None) -> ModelFamily:
    for arch in architectures or []:
        if arch in _FAMILIES:
            return _load(arch)
    raise UnsupportedModelError(
        f"unsupported architecture {architectures}; flashvlm supports: {', '.join(supported_architectures())}")


def family_for_model_type(model_type: str) -> ModelFamily:
    """The family whose checkpoints carry this `config.model_type` (imports every family to ask; they are light)."""
    for arch in _FAMILIES:
        if _load(arch).model_type == model_type:
            return _load(arch)
    raise ValueError(f"no model family for model_type {model_type!r}; known: "
                     f"{sorted(_load(arch).model_type for arch in _FAMILIES)}")


def resolve_model_class(architectures: list[str] | None) -> type[VLModel]:
    return resolve_family(architectures).model_class()
