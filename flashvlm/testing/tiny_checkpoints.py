"""Tiny Hugging Face checkpoints built in code, with no download: for tests and the embedded default.

Each builder writes a normal checkpoint folder (config.json, safetensors, tokenizer files, chat
template, preprocessor_config.json, generation_config.json) through transformers' own classes, so
our loader is exercised on exactly what users have on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>"]
LLAVA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<image>", "<pad>"]

QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or content['type'] == 'image_url' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or content['type'] == 'image_url' %}"
    "<image>\n{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'user' %} {% else %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "A red circle sits left of a blue square.",
    "How many triangles are in the picture? There are three.", "What colour is the shape? It is green.",
    "Describe the image in one sentence.", "The screenshot shows an error dialog with the code 404.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026.", "yes no maybe left right top bottom above below",
    "Unicode text: café, naïve, 東京, 😀 emoji.", "USER: ASSISTANT: system user assistant",
]
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_tokenizer(special_tokens: list[str], vocab_size: int, chat_template: str, eos: str, bos: str | None,
                    pad: str | None, corpus: list[str] | None = None):
    """A byte-level BPE trained on an in-code corpus: deterministic, tiny, and round-trips any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=pad,
                                   chat_template=chat_template, model_max_length=1 << 20)


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


def _save(model, tokenizer, path: Path, preprocessor: dict, legacy_layout: bool | None, shard_size: str | None) -> Path:
    """legacy_layout None: what save_pretrained writes; True/False: rewrite a single safetensors file in
    the pre-4.52 Qwen layout (visual.*, model.*) or the in-memory layout (model.visual.*,
    model.language_model.*), so tests cover both."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size=shard_size or "2GB")
    if legacy_layout is not None:
        from safetensors.torch import save_file

        for f in path.glob("model*.safetensors*"):
            f.unlink()
        state = model.state_dict()
        if legacy_layout:
            state = _legacy_qwen_layout(state)
        state = {k: v.contiguous() for k, v in state.items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    return path


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
        GenerationConfig,
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
        vision = dict(depth=vision_depth * 2, hidden_size=vision_width, intermediate_size=2 * vision_width, num_heads=2,
                      out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                      window_size=56, fullatt_block_indexes=[1, 3][: max(1, vision_depth)], hidden_act="silu")
        cfg_cls, model_cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    else:
        vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden, num_heads=2, mlp_ratio=2,
                      patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
        cfg_cls, model_cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    cfg = cfg_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                  video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    _randomize(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                                               pad_token_id=ids["<|endoftext|>"])
    return _save(model, tokenizer, Path(path), qwen_preprocessor_config(min_pixels, max_pixels, qwen25),
                 legacy_layout, shard_size)


def build_llava(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, image_size: int = 56,
                shard_size: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """A tiny llava-hf style LLaVA-1.5 checkpoint (CLIP ViT + GELU projector + Llama)."""
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = build_tokenizer(LLAVA_SPECIAL_TOKENS, 480, LLAVA_CHAT_TEMPLATE, eos="</s>", bos="<s>",
                                pad="<pad>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in LLAVA_SPECIAL_TOKENS}
    text = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       rms_norm_eps=1e-5, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                       pad_token_id=ids["<pad>"])
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                              image_size=image_size, patch_size=14, projection_dim=32, hidden_act="quick_gelu")
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                      image_seq_length=(image_size // 14) ** 2, vision_feature_layer=-2,
                      vision_feature_select_strategy="default", projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).to(dtype).eval()
    _randomize(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=ids["</s>"], bos_token_id=ids["<s>"],
                                               pad_token_id=ids["<pad>"])
    preprocessor = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
                    "do_resize": True, "size": {"shortest_edge": image_size}, "resample": 3,
                    "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
                    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                    "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}
    return _save(model, tokenizer, Path(path), preprocessor, None, shard_size)


def _mrope_section(head_dim: int) -> list[int]:
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; random values everywhere make parity tests able to fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
