"""The tiny llava-hf LLaVA-1.5 checkpoint of the tests (see checkpoint_writer.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from flashvlm.testing.checkpoint_writer import CLIP_MEAN, CLIP_STD, build_tokenizer, randomize, save_checkpoint

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
    from transformers import CLIPVisionConfig, GenerationConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    tokenizer = build_tokenizer(LLAVA_SPECIAL_TOKENS, 480, LLAVA_CHAT_TEMPLATE, eos="</s>", bos="<s>",
                                pad="<pad>", add_bos=add_bos)
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
    randomize(model, seed)
    model.generation_config = GenerationConfig(eos_token_id=ids["</s>"], bos_token_id=ids["<s>"],
                                               pad_token_id=ids["<pad>"])
    preprocessor = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
                    "do_resize": True, "size": {"shortest_edge": image_size}, "resample": 3,
                    "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
                    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                    "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}
    return save_checkpoint(model, tokenizer, Path(path), preprocessor, shard_size)
