"""The fused masked greedy kernel (kernels/masked_greedy.py) against its torch reference and against the sampler's
own greedy path, on fresh random logits, bitmasks and bans.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (float32 logits); with CUDA, compiled,
in float32 and bfloat16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

pytest.importorskip("triton")

from flashvlm.kernels.masked_greedy import masked_greedy_reference, masked_greedy_triton  # noqa: E402
from flashvlm.request import SamplingParams  # noqa: E402
from flashvlm.runner.sampler import Sampler, SamplerInputs  # noqa: E402
from flashvlm.runner.token_mask import TokenMask, words_per_row  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


def _bitmask(rows: int, vocab: int, density: float, gen: torch.Generator) -> torch.Tensor:
    bits = torch.rand(rows, words_per_row(vocab) * 32, generator=gen) < density
    bits[:, vocab:] = False
    words = (bits.view(rows, -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 words


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1000, 5003])  # one block, several blocks (BLOCK 2048), not a multiple of 32
def test_kernel_matches_reference(dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    num_rows = 6
    logits = torch.randn(num_rows, vocab, generator=gen).to(dtype)
    bitmask = _bitmask(3, vocab, 0.3, gen)
    mask_rows = torch.tensor([0, -1, 1, 2, -1, 1], dtype=torch.int32)
    top = logits.float().argmax(dim=-1)
    banned = torch.full((num_rows, 3), -1, dtype=torch.int64)
    banned[1, :2] = top[1]  # an unconstrained row whose best token is banned
    banned[2, :] = torch.tensor([5, vocab - 1, vocab + 7])  # one id past the vocabulary: ignored
    # Row 3: its mask allows only the banned tokens, so the ban yields (the sampler's complete-constraint rule).
    bitmask[2] = 0
    for t in (11, 700):
        bitmask[2, t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)
    banned[3, :2] = torch.tensor([11, 700])
    # Row 4: the maximum twice, in one lane of two blocks when there are several (BLOCK 2048): the first wins.
    twin = 3 + 2048 if vocab > 2051 else vocab - 2
    logits[4, 3] = logits[4, twin] = logits[4].float().max().to(dtype) + 1
    args = (bitmask, mask_rows, banned)
    expected = masked_greedy_reference(logits, *args)
    got = masked_greedy_triton(logits.to(DEVICE), *(a.to(DEVICE) for a in args)).cpu()
    assert torch.equal(got, expected)
    assert got[3].item() in (11, 700) and got[4].item() == 3 and got[1].item() != top[1].item()


@pytest.mark.parametrize("seed", [0, 1])
def test_sampler_greedy_kernel_equals_its_torch_path(seed: int) -> None:
    # The production reference: Sampler.apply_penalties then argmax, with a token mask on some rows, rows below
    # min_tokens (with and without ignore_eos) and rows past it.
    gen = torch.Generator().manual_seed(seed)
    vocab, eos = 3000, (2, 9)
    params = [SamplingParams(temperature=0.0, min_tokens=m, ignore_eos=i, stop_token_ids=s)
              for m, i, s in ((4, False, [17]), (0, False, []), (4, True, [23, 2999]), (1, False, []), (9, False, []))]
    rows = SamplerInputs(params=params, prev_token_ids=[()] * 5, num_output_tokens=[1, 3, 2, 5, 0],
                         eos_token_ids=[eos] * 5, generators=[None] * 5,
                         token_mask=TokenMask([0, 2, 3], _bitmask(3, vocab, 0.2, gen)))
    logits = torch.randn(5, vocab, generator=gen)
    logits[0, 17] = logits[2, 23] = logits[4, 9] = 50.0  # banned tokens that would win otherwise
    sampler = Sampler()
    expected = sampler.greedy(logits, rows, use_kernel=False)
    assert torch.equal(expected, sampler.apply_penalties(logits, rows).argmax(dim=-1))
    got = sampler.greedy(logits.to(DEVICE), rows, use_kernel=True).cpu()
    assert torch.equal(got, expected) and got[4].item() != 9
