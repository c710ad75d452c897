"""The tiny llava-hf LLaVA-NeXT (1.6) checkpoint of the tests (see checkpoint_writer.py): a 56-pixel CLIP tile (4x4
features), HF's default pinpoints scaled to it (so 2 to 3 crops a picture), a Mistral text model without a sliding
window, and a tokenizer that adds `<s>` as the 1.6 checkpoints' Llama tokenizers do (the template writes none)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashvlm.testing.checkpoint_writer import CLIP_MEAN, CLIP_STD, build_tokenizer, randomize, save_checkpoint
from flashvlm.testing.tiny_llava import LLAVA_SPECIAL_TOKENS

LLAVA_NEXT_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST] "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}<image>\n"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %} [/INST]"
    "{% else %} {% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>{% endif %}{% endfor %}"
)


def tiny_pinpoints(tile: int) -> list[list[int]]:
    """HF's default image_grid_pinpoints ([[336, 672], ...] for 336-pixel tiles) for another tile size."""
    return [[tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile], [3 * tile, tile], [tile, 3 * tile]]


def _legacy_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The names llava-hf's hub checkpoints carry (language_model.model.*, vision_tower.*, image_newline)."""
    out = {}
    for name, tensor in state.items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model."):]
        elif name == "lm_head.weight":
            name = "language_model.lm_head.weight"
        elif name.startswith("model."):
            name = name[len("model."):]
        out[name] = tensor
    return out


def build_llava_next(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, tile: int = 56,
                     shard_size: str | None = None, dtype: torch.dtype = torch.float32,
                     legacy_layout: bool = False) -> Path:
    """A tiny llava-hf style LLaVA-NeXT checkpoint (CLIP ViT tiles + GELU projector + image_newline + Mistral).
    legacy_layout: one safetensors file with the hub checkpoints' tensor names instead of save_pretrained's."""
    from transformers import (
        CLIPVisionConfig,
        GenerationConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        MistralConfig,
    )

    tokenizer = build_tokenizer(LLAVA_SPECIAL_TOKENS, 480, LLAVA_NEXT_CHAT_TEMPLATE, eos="</s>", bos="<s>",
                                pad="<pad>", add_bos=True)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL_TOKENS}
    text = MistralConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rms_norm_eps=1e-5, sliding_window=None, rope_theta=1e6, bos_token_id=ids["<s>"],
                         eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"])
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=tile, patch_size=14, projection_dim=32, hidden_act="quick_gelu")
    pinpoints = tiny_pinpoints(tile)
    cfg = LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                          image_grid_pinpoints=pinpoints, image_seq_length=(tile // 14) ** 2,
                          vision_feature_layer=-2, vision_feature_select_strategy="default",
                          projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(cfg).to(dtype).eval()
    randomize(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=ids["</s>"], bos_token_id=ids["<s>"],
                                               pad_token_id=ids["<pad>"])
    preprocessor = {"image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor",
                    "do_resize": True, "size": {"shortest_edge": tile}, "resample": 3, "do_center_crop": True,
                    "crop_size": {"height": tile, "width": tile}, "do_rescale": True, "rescale_factor": 1 / 255,
                    "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True,
                    "do_pad": True, "image_grid_pinpoints": pinpoints}
    return save_checkpoint(model, tokenizer, Path(path), preprocessor, shard_size,
                           _legacy_layout if legacy_layout else None)
