"""The tiny Fuyu checkpoint of the tests (see checkpoint_writer.py): transformers' own FuyuForCausalLM with seeded
random weights, and a tokenizer built here that behaves as FuyuProcessor expects of adept's: a SentencePiece-like
tokenizer puts a word-start piece before a string that opens with |SPEAKER|, which FuyuProcessor strips from the
image's placeholders, so this one does too (a unigram model over its own pieces, |SPEAKER| and |NEWLINE| among
them, after a normalizer that prepends the word-start piece), and it adds <s> in front of a text encoded with
special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flashvlm.testing.checkpoint_writer import _CORPUS, save_checkpoint, seeded_model

FUYU_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
FUYU_PIECES = ["|SPEAKER|", "|NEWLINE|", "<0x04>"]
"""Pieces of the model's own vocabulary, as in adept's tokenizer: matched after the word-start piece is prepended."""


def build_fuyu_tokenizer(vocab_size: int = 400):
    """A SentencePiece-like unigram tokenizer trained on the in-code corpus (characters outside it are <unk>)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained = Tokenizer(models.Unigram())
    trained.normalizer = normalizer
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=FUYU_SPECIAL_TOKENS, unk_token="<unk>",
                                      show_progress=False)
    trained.train_from_iterator(_CORPUS * 4, trainer)
    pieces = [tuple(p) for p in json.loads(trained.to_str())["model"]["vocab"]] + [(p, 0.0) for p in FUYU_PIECES]
    tok = Tokenizer(models.Unigram(pieces, unk_id=0))
    tok.normalizer = normalizer
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.add_special_tokens(FUYU_SPECIAL_TOKENS)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", model_max_length=1 << 20)


def fuyu_preprocessor_config(canvas_hw: tuple[int, int] = (180, 240), patch: int = 30) -> dict:
    return {"image_processor_type": "FuyuImageProcessor", "processor_class": "FuyuProcessor",
            "do_resize": True, "size": {"height": canvas_hw[0], "width": canvas_hw[1]}, "resample": 2,
            "do_pad": True, "padding_value": 1.0, "padding_mode": "constant", "do_normalize": True,
            "image_mean": 0.5, "image_std": 0.5, "do_rescale": True, "rescale_factor": 1 / 255,
            "patch_size": {"height": patch, "width": patch}}


def _legacy_fuyu_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adept/fuyu-8b hub naming: language_model.model.*, language_model.lm_head.*, vision_embed_tokens.*"""
    out = {}
    for name, t in state.items():
        if name.startswith("model.language_model."):
            name = "language_model.model." + name[len("model.language_model."):]
        elif name.startswith("model.vision_embed_tokens."):
            name = name[len("model."):]
        elif name.startswith("lm_head."):
            name = "language_model." + name
        out[name] = t
    return out


def build_fuyu(path: str | Path, *, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
               canvas_hw: tuple[int, int] = (180, 240), legacy_layout: bool = False, shard_size: str | None = None,
               dtype: torch.dtype = torch.float32) -> Path:
    """A tiny Fuyu checkpoint (30x30 patches, Persimmon decoder with QK-norm and half-rotary heads); the canvas
    is small so that the tests' larger images are shrunk. legacy_layout: tensors named as adept/fuyu-8b names them."""
    from transformers import FuyuConfig, FuyuForCausalLM, PersimmonConfig

    tokenizer = build_fuyu_tokenizer()
    vocab = tokenizer.get_vocab()
    ids = {t: vocab[t] for t in FUYU_SPECIAL_TOKENS + FUYU_PIECES}
    text = dict(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, hidden_act="relu2", max_position_embeddings=4096, layer_norm_eps=1e-5,
                qk_layernorm=True, rope_parameters={"rope_type": "default", "rope_theta": 25000.0,
                                                    "partial_rotary_factor": 0.5},
                bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=None)
    # transformers 5.17 keeps the text fields at the top level too and sizes the patch projection from them.
    top = {k: v for k, v in text.items() if k in getattr(FuyuConfig, "__dataclass_fields__", {})}
    cfg = FuyuConfig(text_config=PersimmonConfig(**text), image_token_id=ids["|SPEAKER|"], patch_size=30,
                     num_channels=3, **top)
    model = seeded_model(FuyuForCausalLM, cfg, seed, dtype, eos_token_id=ids["</s>"], bos_token_id=ids["<s>"])
    path = save_checkpoint(model, tokenizer, Path(path), fuyu_preprocessor_config(canvas_hw), shard_size,
                           single_file=_legacy_fuyu_layout if legacy_layout else None)
    # Top-level copies of the text fields, as adept/fuyu-8b's config.json has them: transformers 5.17 sizes the
    # patch projection from the top-level hidden_size (default 4096) and later versions ignore them.
    config = json.loads((path / "config.json").read_text())
    top = {k: text[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                "num_attention_heads", "hidden_act", "max_position_embeddings", "layer_norm_eps",
                                "qk_layernorm", "bos_token_id", "eos_token_id")}
    (path / "config.json").write_text(json.dumps({**top, **config}, indent=2))
    return path
