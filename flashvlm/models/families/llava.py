"""LLaVA-1.5 in llava-hf form. Its parts: `models/llava.py` (model, projector, weight names of both llava-hf
layouts), `models/vision/clip.py` (the CLIP tower up to the feature layer), `processing/clip_image.py` (pad, resize,
crop; a fixed token count, no item layout), the load check below, `testing/tiny_llava.py`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flashvlm.models.registry import ModelFamily

if TYPE_CHECKING:
    from flashvlm.models.loader import Checkpoint
    from flashvlm.processing.clip_image import ClipImageInputs
    from flashvlm.request import MMItem


class LlavaFamily(ModelFamily):
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


LLAVA = LlavaFamily("LlavaForConditionalGeneration", "llava", "<image>\n", model_module="flashvlm.models.llava",
                    image_processor="flashvlm.processing.clip_image:ClipImageProcessor",
                    tiny_checkpoint="flashvlm.testing.tiny_llava:build_llava")
