"""Qwen3-VL, the dense models (the MoE variant, Qwen3VLMoeForConditionalGeneration, is not served). Its parts:
`models/qwen3_vl.py` (the decoder with QK-norm, interleaved M-RoPE and DeepStack), `models/vision/qwen3_vit.py`
(the tower and its DeepStack mergers), `testing/tiny_qwen3.py`. Images go through Qwen2-VL's processor
(`processing/qwen_image.py`, 16-pixel patches from the checkpoint's preprocessor config) and take Qwen2-VL's
prompt positions; the benchmark baseline passes the same inputs as Qwen2-VL's, `mm_token_type_ids` included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashvlm.models.families.qwen2_vl import QwenVLFamily
from flashvlm.models.registry import import_ref


class Qwen3VLFamily(QwenVLFamily):
    def __init__(self) -> None:
        super().__init__("Qwen3VLForConditionalGeneration", "qwen3_vl", qwen25=False,
                         model_module="flashvlm.models.qwen3_vl",
                         tiny_checkpoint="flashvlm.testing.tiny_qwen3:build_qwen3_vl")

    def build_tiny_checkpoint(self, path: str | Path, **kwargs: Any) -> Path:
        # Qwen3-VL's builder has no qwen25 switch, which Qwen2-VL's builder takes.
        return import_ref(self.tiny_checkpoint_ref)(path, **kwargs)


QWEN3_VL = Qwen3VLFamily()
