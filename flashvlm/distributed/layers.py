"""The layers of a sharded model that communicate. Column-parallel projections (QKV, gate/up) need none: they are
the model's own MergedLinear with fewer output rows (shard.py slices them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flashvlm.distributed.group import TPGroup
from flashvlm.layers.linear import Linear, PlainLinear, linear


def _take_columns(layer: nn.Linear, full: nn.Linear, start: int, end: int) -> None:
    """`layer` (built end - start wide) takes columns [start, end) of `full`'s weight and all of its bias."""
    layer.to(device=full.weight.device, dtype=full.weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(full.weight[:, start:end])
        if full.bias is not None:
            layer.bias.copy_(full.bias)


class RowParallelLinear(Linear):
    """A Linear holding this rank's slice of the input columns: partial products summed over ranks, then the
    bias once (o_proj, down_proj)."""

    def __init__(self, full: nn.Linear, group: TPGroup, start: int, end: int) -> None:
        super().__init__(end - start, full.out_features, bias=full.bias is not None)
        _take_columns(self, full, start, end)
        self.group = group
        for name in ("use_triton_kernels", "gemv_max_rows"):
            if hasattr(full, name):
                setattr(self, name, getattr(full, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, None, max_rows=self.gemv_max_rows, enabled=self.use_triton_kernels,
                     locks=self.gemv_locks)
        out = self.group.all_reduce(out)
        return out if self.bias is None else out + self.bias


class PlainRowParallelLinear(PlainLinear):
    """RowParallelLinear for the vision towers and projectors: their product stays F.linear at every row count
    (PlainLinear), then the sum over ranks and the bias once."""

    def __init__(self, full: nn.Linear, group: TPGroup, start: int, end: int) -> None:
        super().__init__(end - start, full.out_features, bias=full.bias is not None)
        _take_columns(self, full, start, end)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def vocab_range(vocab: int, group: TPGroup) -> tuple[int, int, int]:
    """(start, end, rows per rank): rank r holds rows [start, end) of a vocabulary split in equal padded parts."""
    per_rank = -(-vocab // group.size)
    start = min(group.rank * per_rank, vocab)
    return start, min(start + per_rank, vocab), per_rank


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding (zero-padded to an equal share): each rank looks up the ids it holds,
    zeros the others, and the sum over ranks is the full lookup."""

    def __init__(self, full: nn.Embedding, group: TPGroup) -> None:
        super().__init__()
        self.group = group
        self.num_embeddings, self.embedding_dim = full.num_embeddings, full.embedding_dim
        self.start, self.end, per_rank = vocab_range(full.num_embeddings, group)
        weight = full.weight.new_zeros(per_rank, full.embedding_dim)
        weight[: self.end - self.start] = full.weight.detach()[self.start : self.end]
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (ids < self.start) | (ids >= self.end)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class ParallelLMHead(Linear):
    """This rank's vocabulary rows of the LM head (or of a tied embedding): the logits of every rank are gathered,
    so each rank holds the full row and samples it alike."""

    def __init__(self, weight: torch.Tensor, vocab: int, group: TPGroup, bias: torch.Tensor | None = None) -> None:
        start, end, per_rank = vocab_range(vocab, group)
        super().__init__(weight.shape[1], per_rank, bias=bias is not None)
        self.to(device=weight.device, dtype=weight.dtype)
        self.group, self.vocab = group, vocab
        with torch.no_grad():
            self.weight.zero_()
            self.weight[: end - start] = weight[start:end] if weight.shape[0] == vocab else weight[: end - start]
            if bias is not None:
                self.bias.zero_()
                self.bias[: end - start] = bias[start:end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        return self.group.all_gather(logits, dim=-1)[..., : self.vocab]
