"""An image's pruning setting as the engine carries it: which strategy, which keep ratio, and the merged grid of
the vision tower's full output. The input processor resolves it per request (engine default, then the request's
`mm_processor_kwargs`) and puts it on the `MMItem`; the runner, the prefix cache and the positions read it there.
No torch here: the input processor and the scheduler's side read it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashvlm.pruning.base import PruningSettingError, TokenGrid, kept_count, validate_keep_ratio
from flashvlm.pruning.registry import PRUNING_STRATEGIES, get_strategy

PRUNING_KWARGS = ("mm_token_pruning", "mm_token_keep_ratio")
"""The `mm_processor_kwargs` keys that set a request's pruning; the family's processor never sees them."""

ENGINE_STRATEGIES = ("none", "pool", "divprune")
"""The strategies the engine runs: those whose kept count is known before the vision tower runs, so the prompt's
placeholders can be expanded to it. `dedup`'s count follows the picture (known only after the tower)."""


class PruningNotRunError(PruningSettingError):
    """A strategy that exists but that the engine does not run (dedup)."""


def strategy_problem(name: Any) -> str | None:
    """What is wrong with `name` as a strategy the engine runs, or None."""
    if not isinstance(name, str) or name not in PRUNING_STRATEGIES:
        return (f"unknown visual-token pruning strategy {name!r} for mm_token_pruning; flashvlm has "
                f"{', '.join(PRUNING_STRATEGIES)}")
    if name not in ENGINE_STRATEGIES:
        return (f"mm_token_pruning {name!r} is not run by the engine yet: its kept count is known only after the "
                f"vision tower, and the prompt's placeholders are expanded before it; use one of "
                f"{', '.join(ENGINE_STRATEGIES)}")
    return None


def resolve_setting(default: tuple[str, float], kwargs: dict[str, Any]) -> tuple[str, float]:
    """The (strategy, keep ratio) of a request: the engine's `default`, each replaced by the request's
    `mm_token_pruning` / `mm_token_keep_ratio` where given. Raises PruningSettingError naming the bad value."""
    strategy = kwargs.get("mm_token_pruning", default[0])
    problem = strategy_problem(strategy)
    if problem is not None:
        raise PruningNotRunError(problem) if strategy in PRUNING_STRATEGIES else PruningSettingError(problem)
    return strategy, validate_keep_ratio(kwargs.get("mm_token_keep_ratio", default[1]))


@dataclass(frozen=True)
class TokenPruning:
    """How one image's tokens are pruned. An item carries one only when it keeps fewer tokens than the tower
    yields; without one the item is exactly the unpruned item."""

    strategy: str
    keep_ratio: float
    grid: TokenGrid
    """The merged grid of the tower's full output (its `num_tokens` embeddings, in raster order)."""

    @property
    def num_full_tokens(self) -> int:
        return self.grid.num_tokens

    @property
    def num_kept(self) -> int:
        return kept_count(self.grid.num_tokens, self.keep_ratio)

    @property
    def key(self) -> str:
        """Names the setting in cache keys (the prefix cache's block hash, the runner's kept indices): two
        settings with different keys never share KV or indices."""
        return f"{self.strategy}:{self.keep_ratio!r}"

    def select(self, embeddings: Any) -> Any:
        """The sorted kept indices (a tensor on the embeddings' device) of the full `embeddings`."""
        return get_strategy(self.strategy).select(embeddings, self.grid, self.keep_ratio)


NO_GRID_EXAMPLES = ("LLaVA-NeXT: a base image, then tiles with a newline token per row; LLaVA with "
                    "vision_feature_select_strategy 'full': the CLS token")
"""The families whose image tokens form no grid, for the refusal's message."""


def pruning_for(strategy: str, keep_ratio: float, grid: TokenGrid | None, num_tokens: int) -> TokenPruning | None:
    """The item's TokenPruning for a resolved setting, or None when it keeps every one of the tower's
    `num_tokens` (strategy none, or a ratio that keeps all). `grid` None: the family's tokens form no grid."""
    if strategy == "none":
        return None
    if grid is None:
        raise PruningSettingError(f"mm_token_pruning {strategy!r}: this model's image tokens form no grid "
                                  f"({NO_GRID_EXAMPLES}); use 'none'")
    if grid.num_tokens != num_tokens:
        raise ValueError(f"token grid {grid} has {grid.num_tokens} tokens, the vision tower yields {num_tokens}")
    setting = TokenPruning(strategy, keep_ratio, grid)
    return setting if setting.num_kept < num_tokens else None
