"""Real-size LLaVA benchmark folders (no weights, `load_format="dummy"`): llava-hf's LLaVA-1.5-7B and
LLaVA-v1.6-Mistral-7B configs as their hub folders give them, with a word-level tokenizer over the whole vocabulary
(ids as the hub tokenizers have them for the special tokens) and the image processor config of each."""

from __future__ import annotations

import json
from pathlib import Path

from flashvlm.testing.checkpoint_writer import CLIP_MEAN, CLIP_STD
from flashvlm.testing.tiny_llava import LLAVA_CHAT_TEMPLATE
from flashvlm.testing.tiny_llava_next import LLAVA_NEXT_CHAT_TEMPLATE

LLAVA_SPECIAL_IDS = {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": 32000, "<pad>": 32001}

_CLIP_L_336 = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
               "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
               "projection_dim": 768, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]

LLAVA_1_5_7B = {
    "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "dtype": "float16",
    "image_token_index": 32000, "pad_token_id": 32001, "projector_hidden_act": "gelu", "image_seq_length": 576,
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
    "text_config": {"model_type": "llama", "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 11008,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                    "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2, "dtype": "float16"},
    "vision_config": _CLIP_L_336,
}
LLAVA_NEXT_MISTRAL_7B = {
    "architectures": ["LlavaNextForConditionalGeneration"], "model_type": "llava_next", "dtype": "bfloat16",
    "image_token_index": 32000, "projector_hidden_act": "gelu", "image_seq_length": 576,
    "image_grid_pinpoints": _PINPOINTS, "use_image_newline_parameter": True,
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
    "text_config": {"model_type": "mistral", "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 14336,
                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                    "rope_theta": 1e6, "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2,
                    "dtype": "bfloat16"},
    "vision_config": _CLIP_L_336,
}

_CLIP_336 = {"do_resize": True, "size": {"shortest_edge": 336}, "resample": 3, "do_center_crop": True,
             "crop_size": {"height": 336, "width": 336}, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "do_convert_rgb": True}
LLAVA_CONFIGS = {
    # name -> (config.json, preprocessor_config.json, chat template)
    "llava-1.5-7b": (LLAVA_1_5_7B, {**_CLIP_336, "image_processor_type": "CLIPImageProcessor"}, LLAVA_CHAT_TEMPLATE),
    "llava-v1.6-mistral-7b": (LLAVA_NEXT_MISTRAL_7B, {**_CLIP_336, "image_processor_type": "LlavaNextImageProcessor",
                                                      "do_pad": True, "image_grid_pinpoints": _PINPOINTS},
                              LLAVA_NEXT_CHAT_TEMPLATE),
}


def write_llava_model(name: str, path: Path) -> Path:
    from flashvlm.bench.model_configs import word_tokenizer

    config, preprocessor, template = LLAVA_CONFIGS[name]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    tokenizer = word_tokenizer(config["text_config"]["vocab_size"], LLAVA_SPECIAL_IDS, "</s>", "<pad>",
                               chat_template=template, bos="<s>")
    tokenizer.save_pretrained(path)
    return path
