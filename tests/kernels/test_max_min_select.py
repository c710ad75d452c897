"""The max-min selection kernel (kernels/max_min_select.py) against its torch reference, and divprune through it
against divprune through the reference, on fresh random embeddings.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter; with CUDA, compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

pytest.importorskip("triton")

from flashvlm.kernels.max_min_select import max_min_select_triton  # noqa: E402
from flashvlm.kernels.max_min_torch import max_min_select_reference  # noqa: E402
from flashvlm.pruning.divprune import cosine_distances, max_min_diverse  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _distances(n: int, dim: int, gen: torch.Generator, duplicates: bool = False) -> torch.Tensor:
    x = torch.randn(n, dim, generator=gen)
    if duplicates:  # exact copies tie at distance 0: the first index must win, as in the reference
        x[n // 2:] = x[: n - n // 2]
    d = cosine_distances(x.to(DEVICE))
    d.fill_diagonal_(-1.0)
    return d


@pytest.mark.parametrize(("n", "count", "block"), [
    (37, 9, None),    # registers, a ragged block
    (256, 64, None),  # registers, a full block
    (300, 80, 64),    # scratch: five chunks, the last ragged
    (128, 128, 32),   # every row picked: the last picks are the -1 diagonal's order
])
def test_kernel_matches_reference(n: int, count: int, block: int | None) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + count)
    distances = _distances(n, 48, gen)
    seed = torch.randint(0, n, (1,), generator=gen).to(DEVICE)
    expected = max_min_select_reference(distances, seed, count)
    got = max_min_select_triton(distances, seed, count, block=block)
    assert torch.equal(got.cpu(), expected.cpu())
    assert got.unique().numel() == count and got[0].item() == seed.item()


@pytest.mark.parametrize("block", [None, 16])
def test_ties_go_to_the_first_row(block: int | None) -> None:
    gen = torch.Generator().manual_seed(7)
    distances = _distances(64, 16, gen, duplicates=True)
    seed = torch.tensor([5], device=DEVICE)
    expected = max_min_select_reference(distances, seed, 40)
    got = max_min_select_triton(distances, seed, 40, block=block)
    assert torch.equal(got.cpu(), expected.cpu())
    # Past 32 picks every kept row has a twin at distance 0: the ties are real and resolved the same way.
    assert got.unique().numel() == 40


@pytest.mark.skipif(DEVICE == "cpu", reason="divprune takes the kernel on CUDA tensors only")
def test_divprune_kernel_path_equals_torch_path() -> None:
    gen = torch.Generator().manual_seed(11)
    embeddings = torch.randn(2304, 256, generator=gen).to(DEVICE, torch.bfloat16)  # a 1344x1344 image's count
    with_kernel = max_min_diverse(embeddings, 576, use_kernels=True)
    without = max_min_diverse(embeddings, 576, use_kernels=False)
    assert torch.equal(with_kernel.cpu(), without.cpu())


def test_bad_arguments_are_refused() -> None:
    distances = _distances(8, 4, torch.Generator().manual_seed(1))
    seed = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="count must be in"):
        max_min_select_triton(distances, seed, 9)
    with pytest.raises(ValueError, match="contiguous"):
        max_min_select_triton(distances.T[:, :4], seed, 2)
