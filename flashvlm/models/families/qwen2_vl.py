"""Qwen2-VL and Qwen2.5-VL. Their parts: `models/qwen2_vl.py` (model, weight names of both checkpoint layouts),
`models/vision/qwen_vit.py` (the two towers), `processing/qwen_image.py` and `processing/qwen_grid.py` (smart
resize, patchify, the (t, h, w) grid an item carries as its layout, the largest grid), `testing/tiny_qwen.py`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashvlm.models.registry import ModelFamily

if TYPE_CHECKING:
    import torch

    from flashvlm.models.loader import Checkpoint
    from flashvlm.processing.qwen_image import QwenImageInputs
    from flashvlm.processing.qwen_video import QwenVideoInputs
    from flashvlm.request import MMItem


class QwenVLFamily(ModelFamily):
    def __init__(self, architecture: str, model_type: str, qwen25: bool, *,
                 model_module: str = "flashvlm.models.qwen2_vl",
                 tiny_checkpoint: str = "flashvlm.testing.tiny_qwen:build_qwen2_vl") -> None:
        super().__init__(architecture, model_type, "<|vision_start|><|image_pad|><|vision_end|>",
                         video_placeholder="<|vision_start|><|video_pad|><|vision_end|>", model_module=model_module,
                         image_processor="flashvlm.processing.qwen_image:QwenImageProcessor",
                         tiny_checkpoint=tiny_checkpoint)
        self.qwen25 = qwen25

    def image_inputs(self, checkpoint: Checkpoint) -> QwenImageInputs:
        from flashvlm.processing.qwen_image import QwenImageInputs

        return QwenImageInputs(self.image_processor(checkpoint.preprocessor_config or {}))

    def video_inputs(self, checkpoint: Checkpoint) -> QwenVideoInputs:
        import json

        from flashvlm.processing.qwen_video import QwenVideoInputs

        video_config = checkpoint.path / "video_preprocessor_config.json"
        return QwenVideoInputs.for_family(self.image_processor(checkpoint.preprocessor_config or {}),
                                          checkpoint.hf_config, qwen3=self.model_type == "qwen3_vl",
                                          qwen25=self.qwen25,
                                          video_config=json.loads(video_config.read_text())
                                          if video_config.is_file() else None)

    def vision_patches(self, item: MMItem) -> int:
        return math.prod(item.layout)

    def baseline_image_inputs(self, items: list[MMItem], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                              image_token_id: int, device: str) -> dict[str, torch.Tensor]:
        import torch

        return {"pixel_values": torch.cat([it.model_pixels(device) for it in items]),  # finished on the GPU, as ours
                "image_grid_thw": torch.tensor([it.layout for it in items], device=device),
                "mm_token_type_ids": ((input_ids == image_token_id) & (attention_mask == 1)).long().to(device)}

    def build_tiny_checkpoint(self, path: str | Path, **kwargs: Any) -> Path:
        return super().build_tiny_checkpoint(path, qwen25=self.qwen25, **kwargs)


QWEN2_VL = QwenVLFamily("Qwen2VLForConditionalGeneration", "qwen2_vl", qwen25=False)
QWEN2_5_VL = QwenVLFamily("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", qwen25=True)
