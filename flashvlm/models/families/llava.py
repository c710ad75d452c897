"""LLaVA-1.5 in llava-hf form. Its parts: `models/llava.py` (model, projector, weight names of both llava-hf
layouts), `models/vision/clip.py` (the CLIP tower up to the feature layer), `processing/clip_image.py` (pad, resize,
crop; a fixed token count, no item layout), the load check below, `testing/tiny_llava.py`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashvlm.models.registry import ModelFamily

if TYPE_CHECKING:
    import torch

    from flashvlm.models.interfaces import VLModel
    from flashvlm.models.loader import Checkpoint
    from flashvlm.processing.clip_image import ClipImageInputs, ClipImageProcessor
    from flashvlm.request import MMItem


class LlavaFamily(ModelFamily):
    architecture = "LlavaForConditionalGeneration"
    model_type = "llava"
    image_placeholder = "<image>\n"

    def model_class(self) -> type[VLModel]:
        from flashvlm.models.llava import LlavaForConditionalGeneration

        return LlavaForConditionalGeneration

    def image_processor(self, preprocessor_config: Mapping[str, Any]) -> ClipImageProcessor:
        from flashvlm.processing.clip_image import ClipImageProcessor

        return ClipImageProcessor.from_config(preprocessor_config)

    def image_inputs(self, checkpoint: Checkpoint) -> ClipImageInputs:
        from flashvlm.processing.clip_image import ClipImageInputs

        cfg = checkpoint.hf_config
        return ClipImageInputs(self.image_processor(checkpoint.preprocessor_config or {}),
                               patch_size=cfg.vision_config.patch_size,
                               select_strategy=cfg.vision_feature_select_strategy)

    def check_checkpoint(self, checkpoint: Checkpoint) -> None:
        """A CLIP tower takes one fixed image size: a processor that crops to another one would make every image
        request fail on its placeholder count, so refuse the checkpoint at load time instead."""
        from flashvlm.config import ConfigError

        cfg = checkpoint.hf_config
        image_size = cfg.vision_config.image_size
        try:
            proc = self.image_processor(checkpoint.preprocessor_config)
            proc.num_image_tokens(cfg.vision_config.patch_size)  # raises when the size depends on each image
        except ValueError as e:
            raise ConfigError(f"{checkpoint.path}: image processor config does not fit the LLaVA model: {e}") from e
        height, width = proc.output_hw(image_size, image_size)
        if (height, width) != (image_size, image_size):
            raise ConfigError(
                f"{checkpoint.path}: the image processor makes {height}x{width} images but the vision tower takes "
                f"{image_size}x{image_size} (vision_config.image_size); fix crop_size/size in "
                "preprocessor_config.json (or processor_config.json's image_processor)")

    def vision_patches(self, item: MMItem) -> int:
        return item.encoder_tokens + 1  # with the CLS token the tower runs

    def baseline_image_inputs(self, items: list[MMItem], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              image_token_id: int, device: str) -> dict[str, torch.Tensor]:
        import torch

        return {"pixel_values": torch.stack([it.model_pixels(device) for it in items])}

    def build_tiny_checkpoint(self, path: str | Path, **kwargs: Any) -> Path:
        from flashvlm.testing.tiny_llava import build_llava

        return build_llava(path, **kwargs)


LLAVA = LlavaFamily()
