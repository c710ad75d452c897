"""The tiny Qwen3-VL checkpoint of the tests (see checkpoint_writer.py): the 8B's layout (model.visual.*,
model.language_model.*, lm_head.*), DeepStack from two of three ViT blocks into the first two of three decoder
layers, a position table smaller than the test images' grids and larger than others (resampled both ways)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashvlm.testing.checkpoint_writer import build_tokenizer, save_checkpoint
from flashvlm.testing.tiny_qwen import QWEN_CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS, qwen_model

# Qwen3-VL's template writes no default system turn; otherwise it is Qwen2-VL's.
_DEFAULT_SYSTEM = ("{% if loop.first and message['role'] != 'system' %}"
                   "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}")
QWEN3_CHAT_TEMPLATE = QWEN_CHAT_TEMPLATE.replace(_DEFAULT_SYSTEM, "")
if QWEN3_CHAT_TEMPLATE == QWEN_CHAT_TEMPLATE:
    raise RuntimeError("Qwen2-VL's chat template no longer writes the default system turn this removes")


def qwen3_preprocessor_config(min_pixels: int, max_pixels: int) -> dict:
    """What Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json holds, with the pixel bounds given."""
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    }


def build_qwen3_vl(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 3, vision_depth: int = 3,
                   vision_width: int = 32, deepstack: tuple[int, ...] = (0, 2), num_position_embeddings: int = 36,
                   tie_word_embeddings: bool = False, shard_size: str | None = None,
                   min_pixels: int = 32 * 32 * 4, max_pixels: int = 32 * 32 * 64,
                   dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Qwen3-VL checkpoint with seeded random weights: 4 query heads of 32 (wider than hidden / heads, as
    Qwen3's head_dim may be) over 2 KV heads; the tower has 2 heads of vision_width / 2."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = build_tokenizer(QWEN_SPECIAL_TOKENS, 480, QWEN3_CHAT_TEMPLATE, eos="<|im_end|>", bos=None,
                                pad="<|endoftext|>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    head_dim = 32
    text = dict(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=4096,
                rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings, attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
                                 "mrope_section": [6, 5, 5]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    vision = dict(depth=vision_depth, hidden_size=vision_width, intermediate_size=2 * vision_width, num_heads=2,
                  out_hidden_size=hidden, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=num_position_embeddings, deepstack_visual_indexes=list(deepstack),
                  hidden_act="gelu_pytorch_tanh")
    model = qwen_model(Qwen3VLConfig, Qwen3VLForConditionalGeneration, text, vision, ids, tie_word_embeddings,
                       seed, dtype)
    return save_checkpoint(model, tokenizer, Path(path), qwen3_preprocessor_config(min_pixels, max_pixels),
                           shard_size)
