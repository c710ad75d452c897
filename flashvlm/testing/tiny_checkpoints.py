"""Tiny checkpoints of every family, built in code (see checkpoint_writer.py): `build_tiny` builds any registered
family's; the builders of the families the test suite names are importable from here too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flashvlm.testing.checkpoint_writer import build_tokenizer, save_checkpoint
from flashvlm.testing.tiny_fuyu import build_fuyu
from flashvlm.testing.tiny_llava import LLAVA_CHAT_TEMPLATE, LLAVA_SPECIAL_TOKENS, build_llava
from flashvlm.testing.tiny_llava_next import build_llava_next
from flashvlm.testing.tiny_qwen import (
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    build_qwen2_vl,
    qwen_preprocessor_config,
)
from flashvlm.testing.tiny_qwen3 import QWEN3_CHAT_TEMPLATE, build_qwen3_vl

__all__ = [
    "LLAVA_CHAT_TEMPLATE", "LLAVA_SPECIAL_TOKENS", "QWEN3_CHAT_TEMPLATE", "QWEN_CHAT_TEMPLATE", "QWEN_SPECIAL_TOKENS",
    "build_fuyu", "build_llava", "build_llava_next", "build_qwen2_vl", "build_qwen3_vl", "build_tiny",
    "build_tokenizer", "qwen_preprocessor_config", "save_checkpoint",
]


def build_tiny(architecture: str, path: str | Path, **kwargs: Any) -> Path:
    """The tiny checkpoint of the family registered for `architecture` (a `config.architectures` name)."""
    from flashvlm.models.registry import resolve_family

    return resolve_family([architecture]).build_tiny_checkpoint(path, **kwargs)
