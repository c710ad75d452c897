"""Quantization methods by name (the values of `--quantization`); each module is imported when first used."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flashvlm.quant.base import QuantMethod

_METHODS: dict[str, tuple[str, str]] = {
    "fp8": ("flashvlm.quant.fp8", "Fp8Method"),
    "int8": ("flashvlm.quant.int8", "Int8Method"),
    "int4": ("flashvlm.quant.int4", "Int4Method"),
}
QUANTIZATION_CHOICES: tuple[str, ...] = tuple(_METHODS)


def get_method(name: str) -> QuantMethod:
    if name not in _METHODS:
        raise KeyError(f"unknown quantization method {name!r}; flashvlm has {', '.join(QUANTIZATION_CHOICES)}")
    module, cls = _METHODS[name]
    return getattr(importlib.import_module(module), cls)()


def all_methods() -> list[QuantMethod]:
    return [get_method(name) for name in QUANTIZATION_CHOICES]
