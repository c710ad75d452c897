"""Pruning strategies by name (the values of `--mm-token-pruning` and the `mm_token_pruning` request kwarg); each
module is imported when first asked for, and this one imports no torch."""

from __future__ import annotations

import importlib
from typing import Any

from flashvlm.pruning.base import PixelPruningStrategy, PruningStrategy, UnknownPruningStrategyError

_STRATEGIES: dict[str, tuple[str, str]] = {
    "none": ("flashvlm.pruning.keep_all", "KeepAllStrategy"),
    "pool": ("flashvlm.pruning.pool", "PoolStrategy"),
    "divprune": ("flashvlm.pruning.divprune", "DivPruneStrategy"),
    "dedup": ("flashvlm.pruning.dedup", "DedupStrategy"),
}
PRUNING_STRATEGIES: tuple[str, ...] = tuple(_STRATEGIES)


def get_strategy(name: str, **params: Any) -> PruningStrategy | PixelPruningStrategy:
    """The strategy called `name`, built with `params` (its constructor's keywords, e.g. dedup's threshold): a
    `PixelPruningStrategy` for dedup, which decides from pixels before the vision tower, else a `PruningStrategy`."""
    if not isinstance(name, str) or name not in _STRATEGIES:
        raise UnknownPruningStrategyError(
            f"unknown visual-token pruning strategy {name!r}; flashvlm has {', '.join(PRUNING_STRATEGIES)}")
    module, cls = _STRATEGIES[name]
    return getattr(importlib.import_module(module), cls)(**params)
