"""`temporal`: video-token pruning across frames (in the spirit of EVS, efficient video sampling): a temporal
patch's token whose pixels repeat, within `threshold` intensity levels at every pixel, those of the same token of
the previous temporal patch is dropped; the first patch keeps every token.

Pixels, not embeddings, as `dedup`: the kept tokens are known when the prompt's placeholders are expanded, the
tower still encodes whole frames (its embeddings serve every setting from the encoder cache), and each kept token
keeps its own (t, h, w) position, so the text after the video sits where it would without pruning. A patch keeps
at least its most changed token (the first on a tie), so no frame item is empty."""

from __future__ import annotations

import numpy as np
import torch

from flashvlm.pruning.base import TokenGrid
from flashvlm.pruning.setting import TokenPruning

TEMPORAL = "temporal"
DEFAULT_TEMPORAL_THRESHOLD = 8.0
"""Largest per-pixel difference (of 0-255) that still counts as a repeat: sensor noise and compression."""


def temporal_kept(previous: torch.Tensor, current: torch.Tensor, threshold: float) -> np.ndarray | None:
    """Sorted indices of `current`'s tokens that differ from `previous`'s (both (tokens, F) uint8 pixel blocks of
    one grid) by more than `threshold` at some pixel; None when every token does."""
    if previous.shape != current.shape:
        raise ValueError(f"temporal pruning: blocks {tuple(previous.shape)} and {tuple(current.shape)} differ")
    change = (current.to(torch.int16) - previous.to(torch.int16)).abs().amax(dim=1)
    kept = torch.nonzero(change > threshold).flatten()
    if len(kept) == len(change):
        return None
    if len(kept) == 0:
        kept = change.argmax().view(1)
    out = kept.to(torch.int64).numpy()
    out.flags.writeable = False
    return out


def temporal_pruning(grid: TokenGrid, threshold: float, kept: np.ndarray) -> TokenPruning:
    """The item setting of a pruned temporal patch (its key names the threshold: no KV is shared across them)."""
    return TokenPruning(TEMPORAL, 1.0, grid, float(threshold), kept)


def validate_temporal_threshold(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 255:
        raise ValueError(f"video_pruning_threshold must be a number in [0, 255], got {value!r}")
    return float(value)
