"""Greedy max-min diverse selection in plain torch: the reference of kernels/max_min_select.py and divprune's path
on the CPU or with `kernel_backend="torch"`. No Triton here, so CPU processes never import it."""

from __future__ import annotations

import torch


def max_min_select_reference(distances: torch.Tensor, seed: torch.Tensor, count: int) -> torch.Tensor:
    """(count,) int64 picks in the order picked (the arguments of `max_min_select_triton`): `count` steps of three
    small ops each, with no host sync."""
    pick = seed.reshape(()).to(torch.int64)
    to_kept = torch.full((distances.shape[0],), float("inf"), dtype=distances.dtype, device=distances.device)
    picks = []
    for step in range(count):
        picks.append(pick)
        # index_select, not distances[pick]: a 0-d index tensor would be read on the host.
        to_kept = torch.minimum(to_kept, distances.index_select(0, pick.view(1))[0])
        if step + 1 < count:
            pick = torch.argmax(to_kept)
    return torch.stack(picks)
