"""The tiny Qwen2-VL / Qwen2.5-VL checkpoint of the tests and the embedded default (see checkpoint_writer.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashvlm.testing.checkpoint_writer import CLIP_MEAN, CLIP_STD, build_tokenizer, save_checkpoint, seeded_model

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>"]
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or content['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _legacy_qwen_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers < 4.52 naming: visual.*, model.* (LM), lm_head.*"""
    out = {}
    for name, t in state.items():
        if name.startswith("model.visual."):
            name = name[len("model."):]
        elif name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        out[name] = t
    return out


def qwen_preprocessor_config(min_pixels: int, max_pixels: int, qwen25: bool = False) -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor" if qwen25 else "Qwen2VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "resample": 3,
        "min_pixels": min_pixels, "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    }


def build_qwen2_vl(path: str | Path, *, qwen25: bool = False, seed: int = 0, hidden: int = 64,
                   layers: int = 2, vision_depth: int = 2, vision_width: int = 32, tie_word_embeddings: bool = False,
                   legacy_layout: bool | None = None, shard_size: str | None = None,
                   min_pixels: int = 28 * 28 * 4, max_pixels: int = 28 * 28 * 64,
                   dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Qwen2-VL (or Qwen2.5-VL) checkpoint with seeded random weights. The tower has 2 heads of
    vision_width / 2 (160 gives the real towers' head dim of 80)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    tokenizer = build_tokenizer(QWEN_SPECIAL_TOKENS, 480, QWEN_CHAT_TEMPLATE, eos="<|im_end|>", bos=None,
                                pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    heads = 4
    text = dict(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=2, max_position_embeddings=4096,
                rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                 "mrope_section": _mrope_section(hidden // heads)},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    if qwen25:
        # An intermediate width that is no multiple of 8, like the real 3,420: the loader pads it (layers/mlp.py).
        vision = dict(depth=vision_depth * 2, hidden_size=vision_width, intermediate_size=2 * vision_width + 6,
                      num_heads=2, out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=56, fullatt_block_indexes=[1, 3][: max(1, vision_depth)], hidden_act="silu")
        cfg_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    model = qwen_model(cfg_cls, model_cls, text, vision, ids, tie_word_embeddings, seed, dtype)
    # legacy_layout None: what save_pretrained writes; True/False: one safetensors file in the pre-4.52 layout
    # (visual.*, model.*) or the in-memory one (model.visual.*, model.language_model.*).
    rewrite = None if legacy_layout is None else (_legacy_qwen_layout if legacy_layout else dict)
    return save_checkpoint(model, tokenizer, Path(path), qwen_preprocessor_config(min_pixels, max_pixels, qwen25),
                           shard_size, rewrite)


def qwen_model(cfg_cls: type, model_cls: type, text: dict, vision: dict, ids: dict[str, int],
               tie_word_embeddings: bool, seed: int, dtype: torch.dtype):
    """A Qwen-VL transformers model of these text and vision configs, the special tokens' ids set, with seeded
    random weights everywhere and the generation config the real checkpoints carry."""
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie_word_embeddings)
    return seeded_model(model_cls, cfg, seed, dtype, eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                        pad_token_id=ids["<|endoftext|>"])


def _mrope_section(head_dim: int) -> list[int]:
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]
