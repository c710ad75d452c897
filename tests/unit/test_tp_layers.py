"""The tensor-parallel layers, one rank at a time in one process: a group whose collectives do nothing shows each
rank's part, and the parts combined as the collectives would (sum, concatenation) must give the whole layer's
output, for a vocabulary no rank count divides."""

from __future__ import annotations

import torch
from torch import nn

from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from flashvlm.layers.linear import Linear


class _Part(TPGroup):
    """Rank `rank` of `size`, with the collectives left out (each test combines the ranks' parts itself)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


def test_vocab_parallel_embedding_and_head_cover_an_uneven_vocabulary():
    torch.manual_seed(0)
    vocab, hidden, size = 11, 6, 3
    full = nn.Embedding(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 7, 8, 10])
    parts = [VocabParallelEmbedding(full, _Part(r, size)) for r in range(size)]
    assert [p.weight.shape[0] for p in parts] == [4, 4, 4]  # ceil(11 / 3), the last rank padded with zeros
    with torch.no_grad():
        assert torch.equal(sum(p(ids) for p in parts), full(ids))
        x = torch.randn(5, hidden)
        heads = [ParallelLMHead(full.weight, vocab, _Part(r, size)) for r in range(size)]
        logits = torch.cat([h(x) for h in heads], dim=-1)[:, :vocab]
        torch.testing.assert_close(logits, x @ full.weight.T)
        # a tied head reads the sharded embedding's own (padded) rows
        tied = [ParallelLMHead(p.weight, vocab, _Part(r, size)) for r, p in enumerate(parts)]
        torch.testing.assert_close(torch.cat([h(x) for h in tied], dim=-1)[:, :vocab], x @ full.weight.T)


def test_row_parallel_linear_sums_to_the_whole_with_the_bias_once():
    torch.manual_seed(1)
    full = Linear(8, 5, bias=True)
    x = torch.randn(3, 8)
    parts = [RowParallelLinear(full, _Part(r, 2), 4 * r, 4 * (r + 1)) for r in range(2)]
    with torch.no_grad():
        partial = sum(p(x[:, 4 * r : 4 * (r + 1)]) - full.bias for r, p in enumerate(parts))
        torch.testing.assert_close(partial + full.bias, full(x))
