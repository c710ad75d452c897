"""Writing tiny Hugging Face checkpoints built in code, with no download: for tests and the embedded default.

A family's builder (`testing/tiny_qwen.py`, `testing/tiny_llava.py`, reached through its registry entry) makes a
transformers model with seeded random weights and a tokenizer trained here, and writes a normal checkpoint folder
(config.json, safetensors, tokenizer files, chat template, preprocessor_config.json, generation_config.json)
through transformers' own classes, so our loader is exercised on exactly what users have on disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

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
                    pad: str | None, corpus: list[str] | None = None, add_bos: bool = False):
    """A byte-level BPE trained on an in-code corpus: deterministic, tiny, and round-trips any text. `add_bos`: the
    tokenizer puts `bos` before every text it encodes with special tokens, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((corpus or _CORPUS) * 4, trainer)
    if add_bos:
        if bos is None:
            raise ValueError("add_bos needs a bos token")
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=bos, pad_token=pad,
                                   chat_template=chat_template, model_max_length=1 << 20)


def save_checkpoint(model, tokenizer, path: Path, preprocessor: dict, shard_size: str | None = None,
                    single_file: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> Path:
    """What save_pretrained writes (sharded at shard_size); with `single_file`, the weights rewritten as one
    model.safetensors whose tensor names it maps (a family's other checkpoint layouts, so tests cover them)."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size=shard_size or "2GB")
    if single_file is not None:
        from safetensors.torch import save_file

        for f in path.glob("model*.safetensors*"):
            f.unlink()
        state = {k: v.contiguous() for k, v in single_file(model.state_dict()).items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=1))
    return path


def seeded_model(model_cls: type, cfg: Any, seed: int, dtype: torch.dtype, **generation: Any) -> torch.nn.Module:
    """`model_cls(cfg)` in `dtype` and eval mode, with `randomize`'s weights of this seed and the generation config
    of these keywords (the token ids the real checkpoints' generation_config.json carries)."""
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    randomize(model, seed)
    model.generation_config = GenerationConfig(**generation)
    return model


def randomize(model: torch.nn.Module, seed: int) -> None:
    """HF initialises norms to 1 and biases to 0; random values everywhere make parity tests able to fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln" in name):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))
