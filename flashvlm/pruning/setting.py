"""An image's pruning setting as the engine carries it: which strategy, which keep ratio (and dedup's threshold),
and the merged grid of the vision tower's full output. The input processor resolves it per request (engine
default, then the request's `mm_processor_kwargs`) and puts it on the `MMItem`; the runner, the prefix cache and
the positions read it there. No torch here: the input processor and the scheduler's side read it."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashvlm.pruning.base import PruningSettingError, TokenGrid, kept_count, validate_keep_ratio
from flashvlm.pruning.registry import PRUNING_STRATEGIES, get_strategy

PRUNING_KWARGS = ("mm_token_pruning", "mm_token_keep_ratio", "mm_token_dedup_threshold")
"""The `mm_processor_kwargs` keys that set a request's pruning; the family's processor never sees them."""

DEFAULT_DEDUP_THRESHOLD = 8.0
"""dedup: two neighbouring tokens' pixel blocks count as equal when no pixel of any channel differs by more than
this many intensity levels (of 0-255). See docs/pruning.md for what it keeps."""
DEFAULT_DEDUP_TILE = 4
"""dedup merges only inside tiles of this many tokens a side, so a kept token stands for at most 16."""


class InvalidDedupThresholdError(PruningSettingError):
    pass


def validate_dedup_threshold(value: Any) -> float:
    """`value` as a float in [0, 255] (intensity levels); anything else raises InvalidDedupThresholdError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidDedupThresholdError(f"mm_token_dedup_threshold must be a number of intensity levels in "
                                         f"[0, 255], got {value!r} ({type(value).__name__})")
    threshold = float(value)
    if math.isnan(threshold) or not 0.0 <= threshold <= 255.0:
        raise InvalidDedupThresholdError(f"mm_token_dedup_threshold must be in [0, 255] (the largest pixel "
                                         f"difference, in intensity levels, of blocks that count as equal), got "
                                         f"{value!r}")
    return threshold


def strategy_problem(name: Any) -> str | None:
    """What is wrong with `name` as a strategy, or None."""
    if not isinstance(name, str) or name not in PRUNING_STRATEGIES:
        return (f"unknown visual-token pruning strategy {name!r} for mm_token_pruning; flashvlm has "
                f"{', '.join(PRUNING_STRATEGIES)}")
    return None


@dataclass(frozen=True)
class PruningChoice:
    """A request's (or the engine's default) pruning options, validated."""

    strategy: str = "none"
    keep_ratio: float = 1.0
    dedup_threshold: float = DEFAULT_DEDUP_THRESHOLD


def resolve_setting(default: PruningChoice, kwargs: dict[str, Any]) -> PruningChoice:
    """The pruning of a request: the engine's `default`, each option replaced by the request's
    `mm_token_pruning` / `mm_token_keep_ratio` / `mm_token_dedup_threshold` where given. Raises
    PruningSettingError naming the bad value."""
    strategy = kwargs.get("mm_token_pruning", default.strategy)
    problem = strategy_problem(strategy)
    if problem is not None:
        raise PruningSettingError(problem)
    return PruningChoice(strategy, validate_keep_ratio(kwargs.get("mm_token_keep_ratio", default.keep_ratio)),
                         validate_dedup_threshold(kwargs.get("mm_token_dedup_threshold", default.dedup_threshold)))


def strategy_of(choice: PruningChoice) -> Any:
    """The strategy object a choice runs (dedup built with its threshold)."""
    if choice.strategy == "dedup":
        return get_strategy("dedup", threshold=choice.dedup_threshold, tile=DEFAULT_DEDUP_TILE)
    return get_strategy(choice.strategy)


@dataclass(frozen=True)
class TokenPruning:
    """How one image's tokens are pruned. An item carries one only when it keeps fewer tokens than the tower
    yields; without one the item is exactly the unpruned item."""

    strategy: str
    keep_ratio: float
    grid: TokenGrid
    """The merged grid of the tower's full output (its `num_tokens` embeddings, in raster order)."""
    dedup_threshold: float | None = None
    """Set for dedup (its threshold, part of the key)."""
    kept: Any = field(default=None, compare=False, repr=False)
    """For a pixel strategy (dedup): the kept indices, decided before the tower (a read-only sorted int64 numpy
    array, a function of the pixels, so of the mm_hash, and the setting); None: chosen from the embeddings."""

    @property
    def num_full_tokens(self) -> int:
        return self.grid.num_tokens

    @property
    def num_kept(self) -> int:
        return kept_count(self.grid.num_tokens, self.keep_ratio) if self.kept is None else len(self.kept)

    @property
    def key(self) -> str:
        """Names the setting in cache keys (the prefix cache's block hash, the runner's kept indices): two
        settings with different keys never share KV or indices."""
        if self.dedup_threshold is None:
            return f"{self.strategy}:{self.keep_ratio!r}"
        return f"{self.strategy}:{self.keep_ratio!r}:{self.dedup_threshold!r}:tile{DEFAULT_DEDUP_TILE}"

    def select(self, embeddings: Any, use_kernels: bool = True) -> Any:
        """The sorted kept indices (a tensor on the embeddings' device) of the full `embeddings` (use_kernels: the
        strategy may run its Triton kernels)."""
        if self.kept is not None:
            import torch

            return torch.tensor(self.kept, dtype=torch.int64).to(embeddings.device)
        return get_strategy(self.strategy).select(embeddings, self.grid, self.keep_ratio, use_kernels)


NO_GRID_EXAMPLES = ("LLaVA-NeXT: a base image, then tiles with a newline token per row; LLaVA with "
                    "vision_feature_select_strategy 'full': the CLS token")
"""The families whose image tokens form no grid, for the refusal's message."""


def pruning_for(choice: PruningChoice, grid: TokenGrid | None, num_tokens: int,
                token_pixels: Callable[[], Any] | None = None) -> TokenPruning | None:
    """The item's TokenPruning for a resolved choice, or None when it keeps every one of the tower's
    `num_tokens` (strategy none, a ratio that keeps all, dedup finding nothing to merge). `grid` None: the
    family's tokens form no grid. `token_pixels`: the item's per-token pixel blocks (dedup reads them here);
    None where the family has none."""
    strategy = choice.strategy
    if strategy == "none":
        return None
    if grid is None:
        raise PruningSettingError(f"mm_token_pruning {strategy!r}: this model's image tokens form no grid "
                                  f"({NO_GRID_EXAMPLES}); use 'none'")
    if grid.num_tokens != num_tokens:
        raise ValueError(f"token grid {grid} has {grid.num_tokens} tokens, the vision tower yields {num_tokens}")
    if strategy != "dedup":
        setting = TokenPruning(strategy, choice.keep_ratio, grid)
        return setting if setting.num_kept < num_tokens else None
    if token_pixels is None:
        raise PruningSettingError("mm_token_pruning 'dedup': this model's images give no per-token pixels")
    kept = strategy_of(choice).select_pixels(token_pixels(), grid, choice.keep_ratio).cpu().numpy()
    if len(kept) == num_tokens:
        return None
    kept.flags.writeable = False
    return TokenPruning(strategy, choice.keep_ratio, grid, choice.dedup_threshold, kept)
