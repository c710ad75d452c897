"""Real-size model folders without weights, for benchmarks with `load_format="dummy"`.

Speed does not depend on weight values, so a benchmark needs only config.json, a tokenizer whose
ids cover the whole vocabulary (random weights emit any id), and the image processor config.
"""

from __future__ import annotations

import json
from pathlib import Path

from flashvlm.testing.tiny_checkpoints import QWEN_CHAT_TEMPLATE, qwen_preprocessor_config
from flashvlm.testing.tiny_fuyu import fuyu_preprocessor_config
from flashvlm.testing.tiny_qwen3 import QWEN3_CHAT_TEMPLATE, qwen3_preprocessor_config


def _qwen_config(architecture: str, model_type: str, text: dict, vision: dict) -> dict:
    """A Qwen-VL config.json as the hub has it: the special token ids, text fields and vision fields the three
    real checkpoints below share, around each one's own."""
    return {
        "architectures": [architecture], "model_type": model_type, "dtype": "bfloat16",
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "tie_word_embeddings": False,
        "text_config": {**text, "rms_norm_eps": 1e-6, "hidden_act": "silu", "bos_token_id": 151643,
                        "eos_token_id": 151645, "dtype": "bfloat16"},
        "vision_config": {**vision, "num_heads": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "in_channels": 3},
    }


# Qwen2-VL-7B and Qwen2.5-VL-7B have text models of one shape; only their context length differs.
_QWEN2_7B_TEXT = {
    "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
}
QWEN2_VL_7B = _qwen_config(
    "Qwen2VLForConditionalGeneration", "qwen2_vl",
    {"model_type": "qwen2_vl_text", **_QWEN2_7B_TEXT, "max_position_embeddings": 32768},
    {"model_type": "qwen2_vl_vision", "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4,
     "patch_size": 14, "hidden_act": "quick_gelu"})
QWEN2_5_VL_7B = _qwen_config(
    "Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
    {"model_type": "qwen2_5_vl_text", **_QWEN2_7B_TEXT, "max_position_embeddings": 128000},
    {"model_type": "qwen2_5_vl", "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 3584,
     "patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu",
     "tokens_per_second": 2})
# Qwen/Qwen3-VL-8B-Instruct's config.json as the hub has it (rope_scaling and rope_theta, the vision config's
# model_type "qwen3_vl"), so loading it exercises the layout users download.
QWEN3_VL_8B = _qwen_config(
    "Qwen3VLForConditionalGeneration", "qwen3_vl",
    {"model_type": "qwen3_vl_text", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
     "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
     "max_position_embeddings": 262144, "attention_bias": False,
     "rope_scaling": {"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]},
     "rope_theta": 5000000},
    {"model_type": "qwen3_vl", "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "out_hidden_size": 4096,
     "patch_size": 16, "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
     "hidden_act": "gelu_pytorch_tanh"})
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
CONFIGS = {"qwen2-vl-7b": (QWEN2_VL_7B, QWEN_SPECIAL_IDS), "qwen2.5-vl-7b": (QWEN2_5_VL_7B, QWEN_SPECIAL_IDS),
           "qwen3-vl-8b": (QWEN3_VL_8B, QWEN_SPECIAL_IDS), "fuyu-8b": (FUYU_8B, FUYU_SPECIAL_IDS)}
_PREPROCESSORS = {  # the real checkpoints' pixel bounds where they differ from the qwen2-vl-7b default below
    "qwen2.5-vl-7b": qwen_preprocessor_config(min_pixels=56 * 56, max_pixels=28 * 28 * 16384, qwen25=True),
    "qwen3-vl-8b": qwen3_preprocessor_config(min_pixels=65536, max_pixels=16777216),
    "fuyu-8b": fuyu_preprocessor_config((1080, 1920)),
}
_CHAT_TEMPLATES: dict[str, str | None] = {"qwen3-vl-8b": QWEN3_CHAT_TEMPLATE, "fuyu-8b": None}  # adept ships none
_TOKENS = {  # name -> (generation_config.json, eos token, pad token) where they are not Qwen's
    "fuyu-8b": ({"eos_token_id": 2}, "</s>", "<unk>"),
}


def word_tokenizer(vocab_size: int, special_ids: dict[str, int], eos: str, pad: str,
                   chat_template: str | None = QWEN_CHAT_TEMPLATE, bos: str | None = None):
    """Whitespace word-level tokenizer with one word per id: any sampled id decodes to text. With `bos` it puts that
    token before every text, as Llama's tokenizers do."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    by_id = {i: t for t, i in special_ids.items()}
    vocab = {by_id.get(i, f"w{i}"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=by_id.get(0, "w0")))  # the word of id 0
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_ids])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, special_ids[bos])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos,
                                   chat_template=chat_template, model_max_length=1 << 20)


def write_benchmark_model(name: str, path: str | Path) -> Path:
    """Write config, tokenizer and processor config of a real-size model (no weights) to `path`."""
    from flashvlm.bench.llava_configs import LLAVA_CONFIGS, write_llava_model

    if name in LLAVA_CONFIGS:
        return write_llava_model(name, Path(path))
    if name not in CONFIGS:
        raise ValueError(f"unknown benchmark model {name!r}; known: {benchmark_model_names()}")
    config, special_ids = CONFIGS[name]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    generation, eos, pad = _TOKENS.get(name, ({"eos_token_id": [151645, 151643]}, "<|im_end|>", "<|endoftext|>"))
    (path / "generation_config.json").write_text(json.dumps(generation))
    preprocessor = _PREPROCESSORS.get(name) or qwen_preprocessor_config(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    tokenizer = word_tokenizer(config["text_config"]["vocab_size"], special_ids, eos, pad,
                               _CHAT_TEMPLATES.get(name, QWEN_CHAT_TEMPLATE))
    tokenizer.save_pretrained(path)
    return path


def benchmark_model_names() -> list[str]:
    """Every `--benchmark-model` name."""
    from flashvlm.bench.llava_configs import LLAVA_CONFIGS

    return sorted([*CONFIGS, *LLAVA_CONFIGS])
