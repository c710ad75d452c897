"""LLaVA-1.5 in llava-hf form: CLIP vision tower -> 2-layer MLP projector -> Llama decoder."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flashvlm.layers.activation import get_activation
from flashvlm.layers.linear import PlainLinear
from flashvlm.models.decoder import PACKED_PROJECTIONS, DecoderModel
from flashvlm.models.interfaces import VLModel
from flashvlm.models.vision.clip import CLIP_PACKED_PROJECTIONS, CLIPVisionTower
from flashvlm.models.weight_utils import load_params, module_of
from flashvlm.request import MMItem

_SUPPORTED_TEXT_MODELS = ("llama",)
_SUPPORTED_VISION_MODELS = ("clip_vision_model",)

# load_params matches packed projections by name component anywhere in a name. Vision names reach it
# too, so the vision tower's packing must agree with the decoder's on every shared component.
_PACKED = {**PACKED_PROJECTIONS, **CLIP_PACKED_PROJECTIONS}
if any(PACKED_PROJECTIONS.get(k, v) != v for k, v in CLIP_PACKED_PROJECTIONS.items()):
    raise RuntimeError("CLIP and decoder packed projections disagree")

# checkpoint prefix -> our module prefix, for both the transformers-5 layout and the older one
# (the older one is what llava-hf hub checkpoints and save_pretrained write).
_LM_PREFIXES = (("model.language_model.", "language_model."), ("language_model.model.", "language_model."))
_HEAD_PREFIXES = ("lm_head.", "language_model.lm_head.")
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.")
_PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, in_features: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = PlainLinear(in_features, hidden, bias=bias)
        self.act = get_activation(act)
        self.linear_2 = PlainLinear(hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def _image_token_id(cfg) -> int:
    # transformers 5 aliases the two names; older configs and plain namespaces carry only one.
    for attr in ("image_token_id", "image_token_index"):
        value = getattr(cfg, attr, None)
        if value is not None:
            return int(value)
    raise ValueError("LLaVA config has neither image_token_id nor image_token_index")


class LlavaForConditionalGeneration(VLModel):
    uses_mrope = False
    supported_text_models: tuple[str, ...] = _SUPPORTED_TEXT_MODELS
    """config.text_config.model_type values the shared decoder runs as they are."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        text_cfg, vision_cfg = hf_config.text_config, hf_config.vision_config
        if getattr(text_cfg, "model_type", "llama") not in self.supported_text_models:
            raise ValueError(f"LLaVA text model {text_cfg.model_type!r} is not supported "
                             f"(supported: {', '.join(self.supported_text_models)})")
        if getattr(vision_cfg, "model_type", "clip_vision_model") not in _SUPPORTED_VISION_MODELS:
            raise ValueError(f"LLaVA vision model {vision_cfg.model_type!r} is not supported "
                             f"(supported: {', '.join(_SUPPORTED_VISION_MODELS)})")
        strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {strategy!r} "
                             "(expected 'default' or 'full')")

        self.config = hf_config
        self.image_token_id = _image_token_id(hf_config)
        self.drop_cls = strategy == "default"
        self.vision_tower = CLIPVisionTower(vision_cfg, getattr(hf_config, "vision_feature_layer", -2))
        self.multi_modal_projector = LlavaMultiModalProjector(
            self.vision_tower.out_features, text_cfg.hidden_size,
            getattr(hf_config, "projector_hidden_act", "gelu"),
            getattr(hf_config, "multimodal_projector_bias", True))
        self.init_language_model(hf_config, DecoderModel(
            text_cfg, qkv_bias=getattr(text_cfg, "attention_bias", False), mrope=False))

    @property
    def tokens_per_image(self) -> int:
        return self.vision_tower.num_patches + (0 if self.drop_cls else 1)



    def encode_images(self, items: list[MMItem]) -> list[torch.Tensor]:
        if not items:
            return []
        expected, shape = self.tokens_per_image, self.vision_tower.pixel_shape
        pixel_values = [torch.as_tensor(item.pixel_values) for item in items]
        # Checked per item before stacking, so a bad image is named instead of failing inside torch.stack.
        for item, pv in zip(items, pixel_values):
            if item.encoder_tokens != expected:
                raise ValueError(f"image {item.mm_hash}: {item.encoder_tokens} placeholder tokens unpruned, "
                                 f"the vision tower yields {expected}")
            if tuple(pv.shape) != shape:
                raise ValueError(f"image {item.mm_hash}: pixel_values shape {tuple(pv.shape)}, "
                                 f"the CLIP vision tower expects {shape} (resize/crop in preprocessing)")
        weight = self.vision_tower.embeddings.patch_embedding.weight  # a conv: float under --quantize-vision
        pixels = torch.stack(pixel_values)
        pixels = pixels.to(device=weight.device, dtype=weight.dtype, non_blocking=True)
        features = self.vision_tower(pixels)
        if self.drop_cls:
            features = features[:, 1:]
        return list(self.multi_modal_projector(features).unbind(0))



    def _param_name(self, ckpt_name: str) -> str | None:
        for src, dst in _LM_PREFIXES:
            if ckpt_name.startswith(src):
                return dst + ckpt_name[len(src):]
        for src in _HEAD_PREFIXES:
            if ckpt_name.startswith(src):
                # A tied checkpoint may still carry a copy of the embedding as lm_head; ours reads
                # the embedding directly.
                return None if self.lm_head is None else "lm_head." + ckpt_name[len(src):]
        for src in _VISION_PREFIXES:
            if ckpt_name.startswith(src):
                name = self.vision_tower.param_name(ckpt_name[len(src):])
                return None if name is None else "vision_tower." + name
        for src in _PROJECTOR_PREFIXES:
            if ckpt_name.startswith(src):
                return "multi_modal_projector." + ckpt_name[len(src):]
        return None

    def _expected_unused(self, ckpt_name: str) -> bool:
        """What _param_name skips on purpose: the tied head's copy of the embedding, and the CLIP tensors the
        tower does not run (layers after the feature layer, post_layernorm, position ids)."""
        if ckpt_name.startswith(_HEAD_PREFIXES):
            return self.lm_head is None
        return ckpt_name.startswith(_VISION_PREFIXES) and self._param_name(ckpt_name) is None

    def checkpoint_module(self, ckpt_name: str) -> str | None:
        name = self._param_name(ckpt_name)
        return None if name is None else module_of(name, _PACKED)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_params(self, weights, self._param_name, packed=_PACKED, expected_unused=self._expected_unused)
