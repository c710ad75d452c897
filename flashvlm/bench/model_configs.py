"""Real-size model folders without weights, for benchmarks with `load_format="dummy"`.

Speed does not depend on weight values, so a benchmark needs only config.json, a tokenizer whose
ids cover the whole vocabulary (random weights emit any id), and the image processor config.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashvlm.testing.tiny_checkpoints import QWEN_CHAT_TEMPLATE, qwen_preprocessor_config
from flashvlm.testing.tiny_fuyu import fuyu_preprocessor_config

QWEN2_VL_7B = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "dtype": "bfloat16",
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen2_vl_text", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
        "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
    },
    "vision_config": {
        "model_type": "qwen2_vl_vision", "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "num_heads": 16,
        "mlp_ratio": 4, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "hidden_act": "quick_gelu", "in_channels": 3,
    },
}
QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
                    "<|video_pad|>": 151656}
# adept/fuyu-8b: Persimmon-8B text side (its config.json repeats the text fields at the top level).
_FUYU_8B_TEXT = {
    "vocab_size": 262144, "hidden_size": 4096, "intermediate_size": 16384, "num_hidden_layers": 36,
    "num_attention_heads": 64, "hidden_act": "relu2", "max_position_embeddings": 16384, "layer_norm_eps": 1e-5,
    "qk_layernorm": True, "bos_token_id": 1, "eos_token_id": 2,
}
FUYU_8B = {
    "architectures": ["FuyuForCausalLM"], "model_type": "fuyu", "dtype": "bfloat16", "image_token_id": 71011,
    "patch_size": 30, "num_channels": 3, "image_size": 300, "tie_word_embeddings": False, **_FUYU_8B_TEXT,
    "text_config": {"model_type": "persimmon", **_FUYU_8B_TEXT, "dtype": "bfloat16",
                    "rope_parameters": {"rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.5}},
}
FUYU_SPECIAL_IDS = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x04>": 7, "|SPEAKER|": 71011, "|NEWLINE|": 71019}
CONFIGS = {"qwen2-vl-7b": (QWEN2_VL_7B, QWEN_SPECIAL_IDS), "fuyu-8b": (FUYU_8B, FUYU_SPECIAL_IDS)}
_FOLDER_FILES = {
    # name -> (generation_config.json, preprocessor_config.json, eos token, pad token, chat template); others: Qwen's
    "fuyu-8b": ({"eos_token_id": 2}, fuyu_preprocessor_config((1080, 1920)), "</s>", "<unk>", None),
}


def _word_tokenizer(vocab_size: int, special_ids: dict[str, int], eos: str, pad: str,
                    chat_template: str | None = QWEN_CHAT_TEMPLATE):
    """Whitespace word-level tokenizer with one word per id: any sampled id decodes to text."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    by_id = {i: t for t, i in special_ids.items()}
    vocab = {by_id.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=by_id.get(0, "w0")))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_ids])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad,
                                   chat_template=chat_template, model_max_length=1 << 20)


def write_benchmark_model(name: str, path: str | Path) -> Path:
    """Write config, tokenizer and processor config of a real-size model (no weights) to `path`."""
    if name not in CONFIGS:
        raise ValueError(f"unknown benchmark model {name!r}; known: {sorted(CONFIGS)}")
    config, special_ids = CONFIGS[name]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    generation, preprocessor, eos, pad, template = _FOLDER_FILES.get(name, (
        {"eos_token_id": [151645, 151643]}, qwen_preprocessor_config(min_pixels=56 * 56, max_pixels=28 * 28 * 16384),
        "<|im_end|>", "<|endoftext|>", QWEN_CHAT_TEMPLATE))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps(generation))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    tokenizer = _word_tokenizer(config["text_config"]["vocab_size"], special_ids, eos, pad, template)
    tokenizer.save_pretrained(path)
    return path
