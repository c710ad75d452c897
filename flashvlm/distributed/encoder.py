"""--mm-encoder-tp-mode data: the vision tower stays whole on every rank, each rank encodes its share of the
step's images, and the embeddings are gathered so every rank holds them all (each rank's language model splices
them like a single-GPU engine)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.shard_vision import shard_vision
from flashvlm.request import MMItem

Encode = Callable[[list[MMItem]], list[torch.Tensor]]


def shares(items: list[MMItem], size: int) -> list[list[int]]:
    """Indices of `items` each rank encodes: the next image to the rank with the fewest tokens so far (ties to the
    lower rank), so the split is the same on every rank and close in tokens."""
    load, out = [0] * size, [[] for _ in range(size)]
    for i, item in enumerate(items):
        r = min(range(size), key=lambda k: (load[k], k))
        out[r].append(i)
        load[r] += item.encoder_tokens
    return out


class DataParallelEncoder:
    """Wraps a model's `encode_images`: this rank's share through the tower, then one all-gather of the rows."""

    def __init__(self, encode: Encode, group: TPGroup, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.encode, self.group = encode, group
        self.width, self.dtype, self.device = width, dtype, device

    def __call__(self, items: list[MMItem]) -> list[torch.Tensor]:
        if not items:
            return []
        split = shares(items, self.group.size)
        mine = split[self.group.rank]
        rows = [sum(items[i].encoder_tokens for i in part) for part in split]
        local = self.encode([items[i] for i in mine]) if mine else []
        padded = torch.zeros(max(rows), self.width, dtype=self.dtype, device=self.device)
        if local:
            block = torch.cat(local)
            padded[: block.shape[0]] = block
        gathered = self.group.all_gather(padded.unsqueeze(0), dim=0)
        out: list[torch.Tensor | None] = [None] * len(items)
        for r, part in enumerate(split):
            offset = 0
            for i in part:
                n = items[i].encoder_tokens
                out[i] = gathered[r, offset : offset + n]
                offset += n
        return out  # type: ignore[return-value]


def split_encoder(model, group: TPGroup, mode: str, dtype: torch.dtype, device: torch.device) -> None:
    """Split `model`'s vision work over the group by `mode` (--mm-encoder-tp-mode): 'data' makes
    `encode_images` data-parallel, 'weights' shards the tower (shard_vision.py). No-op at size 1."""
    if group.size == 1:
        return
    if mode == "weights":
        shard_vision(model, group)
    else:
        model.encode_images = DataParallelEncoder(model.encode_images, group, model.embedding_width, dtype, device)
    # The vision graphs replay a whole call by the step's image shapes; neither this rank's share and the gather
    # around it (data) nor the tower's all-reduces inside it (weights) have been captured, so the tower runs eagerly.
    model.vision_graphable = False
