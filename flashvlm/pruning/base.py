"""The contract of a visual-token pruning strategy, and the one definition of how many tokens a keep ratio keeps.

A strategy returns the indices of an image's tokens to keep, sorted, so the kept tokens stay in raster order of
its `TokenGrid` (frame, row, column) and each keeps its own (t, h, w) position. An embedding strategy
(`PruningStrategy`: pool, divprune) sees the tower's merged embeddings `(N, D)` and keeps a count known from the
ratio alone; a pixel strategy (`PixelPruningStrategy`: dedup) sees the preprocessed pixels each token covers
`(N, F)`, before the tower, so a count that follows the picture is still known when the prompt's placeholders are
expanded. Neither changes an embedding, so the encoder cache's full embeddings serve every strategy and ratio.
This module imports no torch at run time (the scheduler and the input processor read `kept_count` and
`validate_keep_ratio`)."""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from torch import Tensor


class PruningSettingError(ValueError):
    """A pruning setting that cannot work (a keep ratio outside (0, 1], an unknown strategy name)."""


class InvalidKeepRatioError(PruningSettingError):
    pass


class UnknownPruningStrategyError(PruningSettingError):
    pass


def validate_keep_ratio(value: Any) -> float:
    """`value` as a float in (0, 1]; anything else (bools, strings, NaN, infinities, 0, > 1) raises
    InvalidKeepRatioError naming the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidKeepRatioError(
            f"mm_token_keep_ratio must be a number in (0, 1], got {value!r} ({type(value).__name__})")
    ratio = float(value)
    if math.isnan(ratio) or not 0.0 < ratio <= 1.0:
        raise InvalidKeepRatioError(
            f"mm_token_keep_ratio must be in (0, 1] (the share of an image's tokens kept), got {value!r}")
    return ratio


def kept_count(num_tokens: int, keep_ratio: float) -> int:
    """How many of `num_tokens` a keep ratio keeps: ceil(num_tokens * keep_ratio), at least 1, at most all.

    The product is rounded to 9 decimals before the ceiling so float noise (100 * 0.07 = 7.000000000000001)
    does not add a token."""
    if num_tokens < 1:
        raise ValueError(f"an image has at least one token, got {num_tokens}")
    ratio = validate_keep_ratio(keep_ratio)
    return min(num_tokens, max(1, math.ceil(round(num_tokens * ratio, 9))))


@dataclass(frozen=True)
class TokenGrid:
    """The merged token grid of one image: `t` frames of `h` rows by `w` columns, tokens in raster order
    (index = (frame * h + row) * w + column). For Qwen-VL it is the patch grid divided by spatial_merge_size."""

    t: int
    h: int
    w: int

    def __post_init__(self) -> None:
        for axis in ("t", "h", "w"):
            size = getattr(self, axis)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"TokenGrid.{axis} must be a positive int, got {size!r}")

    @property
    def num_tokens(self) -> int:
        return self.t * self.h * self.w

    @classmethod
    def from_patch_grid(cls, patch_grid: tuple[int, int, int], merge_size: int) -> TokenGrid:
        """The merged grid of a (t, h, w) patch grid whose h and w the merger divides by `merge_size`."""
        t, h, w = (int(x) for x in patch_grid)
        if h % merge_size or w % merge_size:
            raise ValueError(f"patch grid {patch_grid} is not divisible by the merge size {merge_size}")
        return cls(t, h // merge_size, w // merge_size)


def _check_rows(strategy: str, rows: int, what: str, grid: TokenGrid) -> None:
    if rows != grid.num_tokens:
        raise ValueError(f"{strategy}: {rows} {what} for a grid of {grid.num_tokens} tokens {grid}")


class PruningStrategy(ABC):
    """One way of choosing an image's kept tokens. `select` checks its arguments and calls `_select`, which
    subclasses implement; `_select` must return sorted unique int64 indices on the embeddings' device, at least
    one, and the same ones every call for the same inputs. Similarities are computed in float32 whatever the
    embeddings' dtype."""

    name: ClassVar[str]

    def planned_count(self, num_tokens: int, keep_ratio: float) -> int:
        """How many tokens `select` will keep: it does not depend on the picture."""
        return kept_count(num_tokens, keep_ratio)

    def fewest_kept(self, grid: TokenGrid, keep_ratio: float) -> int:
        """The fewest tokens it keeps of an image of `grid` (the memory profile's bound)."""
        return self.planned_count(grid.num_tokens, keep_ratio)

    def select(self, embeddings: Tensor, grid: TokenGrid, keep_ratio: float, use_kernels: bool = True) -> Tensor:
        """Sorted int64 indices (into the rows of `embeddings`, on its device) of the tokens to keep. use_kernels:
        whether a strategy may run its Triton kernels on CUDA tensors (the engine's kernel_backend)."""
        if embeddings.dim() != 2:
            raise ValueError(f"{self.name}: embeddings must be (tokens, dim), got shape {tuple(embeddings.shape)}")
        _check_rows(self.name, embeddings.shape[0], "embeddings", grid)
        return self._select(embeddings, grid, validate_keep_ratio(keep_ratio), use_kernels)

    @abstractmethod
    def _select(self, embeddings: Tensor, grid: TokenGrid, keep_ratio: float, use_kernels: bool) -> Tensor:
        raise NotImplementedError


class PixelPruningStrategy(ABC):
    """One way of choosing an image's kept tokens from the pixels each token covers, before the vision tower:
    `blocks` is `(N, F)` uint8, row i the F intensity levels (0-255, every pixel and channel, in one order shared
    by all rows) of token i's block of the preprocessed image. `select_pixels` checks its arguments and calls
    `_select_pixels`, which returns sorted unique int64 indices on the blocks' device, at least one and at most
    `kept_count(N, keep_ratio)`, the same ones every call for the same inputs."""

    name: ClassVar[str]

    def fewest_kept(self, grid: TokenGrid, keep_ratio: float) -> int:
        """The fewest tokens `select_pixels` may keep of an image of `grid` (the memory profile's bound)."""
        return 1

    def select_pixels(self, blocks: Tensor, grid: TokenGrid, keep_ratio: float) -> Tensor:
        """Sorted int64 indices (into the rows of `blocks`, on its device) of the tokens to keep."""
        import torch

        if blocks.dim() != 2 or blocks.dtype != torch.uint8:
            raise ValueError(f"{self.name}: pixel blocks must be (tokens, levels) uint8, got "
                             f"{blocks.dtype} {tuple(blocks.shape)}")
        _check_rows(self.name, blocks.shape[0], "pixel blocks", grid)
        return self._select_pixels(blocks, grid, validate_keep_ratio(keep_ratio))

    @abstractmethod
    def _select_pixels(self, blocks: Tensor, grid: TokenGrid, keep_ratio: float) -> Tensor:
        raise NotImplementedError
