"""The tiny llava-hf LLaVA-1.5 checkpoint of the tests (see checkpoint_writer.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from flashvlm.testing.checkpoint_writer import CLIP_MEAN, CLIP_STD, build_tokenizer, save_checkpoint, seeded_model

LLAVA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or content['type'] == 'image_url' %}"
    "<image>\n{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_llava(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, image_size: int = 56,
                shard_size: str | None = None, dtype: torch.dtype = torch.float32, add_bos: bool = False) -> Path:
    """A tiny llava-hf style LLaVA-1.5 checkpoint (CLIP ViT + GELU projector + Llama). `add_bos`: a tokenizer
    that adds `<s>` as llava-hf's Llama tokenizers do (their chat templates write none)."""
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer, ids = llava_tokenizer(LLAVA_CHAT_TEMPLATE, add_bos)
    cfg = LlavaConfig(**llava_fields(LlamaConfig, hidden, layers, image_size, ids))
    model = llava_model(LlavaForConditionalGeneration, cfg, ids, seed, dtype)
    preprocessor = clip_preprocessor_config(image_size, "CLIPImageProcessor", "LlavaProcessor")
    return save_checkpoint(model, tokenizer, Path(path), preprocessor, shard_size)


def llava_tokenizer(chat_template: str, add_bos: bool) -> tuple[Any, dict[str, int]]:
    """The tokenizer of the LLaVA checkpoints (1.5 and NeXT) and its special tokens' ids."""
    tokenizer = build_tokenizer(LLAVA_SPECIAL_TOKENS, 480, chat_template, eos="</s>", bos="<s>", pad="<pad>",
                                add_bos=add_bos)
    return tokenizer, {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL_TOKENS}


def llava_fields(text_cls: type, hidden: int, layers: int, image_size: int, ids: dict[str, int],
                 **text_fields: Any) -> dict[str, Any]:
    """The config keywords of the LLaVA checkpoints (1.5 and NeXT): a `text_cls` decoder (Llama or Mistral) of
    this width and depth, a 3-layer CLIP tower of 14-pixel patches for `image_size` images, and llava-hf's
    feature layer, select strategy and projector."""
    from transformers import CLIPVisionConfig

    text = text_cls(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
                    bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=ids["<pad>"], **text_fields)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=image_size, patch_size=14, projection_dim=32, hidden_act="quick_gelu")
    return dict(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                image_seq_length=(image_size // 14) ** 2, vision_feature_layer=-2,
                vision_feature_select_strategy="default", projector_hidden_act="gelu")


def llava_model(model_cls: type, cfg: Any, ids: dict[str, int], seed: int, dtype: torch.dtype) -> torch.nn.Module:
    """The seeded transformers model with the generation config of llava-hf's checkpoints."""
    return seeded_model(model_cls, cfg, seed, dtype, eos_token_id=ids["</s>"], bos_token_id=ids["<s>"],
                        pad_token_id=ids["<pad>"])


def clip_preprocessor_config(size: int, image_processor_type: str, processor_class: str) -> dict[str, Any]:
    """CLIP's preprocessing (resize the short side, center-crop to a `size` square, CLIP mean and std)."""
    return {"image_processor_type": image_processor_type, "processor_class": processor_class,
            "do_resize": True, "size": {"shortest_edge": size}, "resample": 3,
            "do_center_crop": True, "crop_size": {"height": size, "width": size},
            "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}
