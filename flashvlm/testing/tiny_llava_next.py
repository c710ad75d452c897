"""The tiny llava-hf LLaVA-NeXT (1.6) checkpoint of the tests (see checkpoint_writer.py): a 56-pixel CLIP tile (4x4
features), HF's default pinpoints scaled to it (so 2 to 3 crops a picture), a Mistral text model without a sliding
window, and a tokenizer that adds `<s>` as the 1.6 checkpoints' Llama tokenizers do (the template writes none)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashvlm.testing.checkpoint_writer import save_checkpoint
from flashvlm.testing.tiny_llava import clip_preprocessor_config, llava_fields, llava_model, llava_tokenizer

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
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, MistralConfig

    tokenizer, ids = llava_tokenizer(LLAVA_NEXT_CHAT_TEMPLATE, add_bos=True)
    pinpoints = tiny_pinpoints(tile)
    cfg = LlavaNextConfig(**llava_fields(MistralConfig, hidden, layers, tile, ids, sliding_window=None, rope_theta=1e6),
                          image_grid_pinpoints=pinpoints)
    model = llava_model(LlavaNextForConditionalGeneration, cfg, ids, seed, dtype)
    preprocessor = {**clip_preprocessor_config(tile, "LlavaNextImageProcessor", "LlavaNextProcessor"),
                    "do_pad": True, "image_grid_pinpoints": pinpoints}
    return save_checkpoint(model, tokenizer, Path(path), preprocessor, shard_size,
                           _legacy_layout if legacy_layout else None)
