"""Sampler semantics: greedy parity, filters, penalties, min_tokens, seeds, distribution."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from flashvlm.request import SamplingParams
from flashvlm.runner.sampler import Sampler, SamplerInputs, make_generator

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run(
    sampler: Sampler,
    logits: torch.Tensor,
    params: list[SamplingParams],
    prev: list[list[int]] | None = None,
    num_out: list[int] | None = None,
    eos: list[tuple[int, ...]] | None = None,
    gens: list[torch.Generator | None] | None = None,
) -> torch.Tensor:
    b = logits.shape[0]
    return sampler(logits, SamplerInputs(
        params,
        prev if prev is not None else [[] for _ in range(b)],
        num_out if num_out is not None else [0] * b,
        eos if eos is not None else [() for _ in range(b)],
        gens if gens is not None else [None] * b,
    ))


def random_logits(b: int, v: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * 3).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = random_logits(6, 97, device)
    out = run(Sampler(), logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.dtype == torch.int64 and out.device.type == device
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_and_tiny_top_p_are_greedy(device: str) -> None:
    logits = random_logits(8, 200, device, seed=1)
    sampler = Sampler(torch.Generator(device).manual_seed(0))
    for _ in range(5):
        assert torch.equal(run(sampler, logits, [SamplingParams(top_k=1)] * 8), logits.argmax(-1))
        assert torch.equal(run(sampler, logits, [SamplingParams(top_p=1e-6)] * 8), logits.argmax(-1))
        assert torch.equal(run(sampler, logits, [SamplingParams(min_p=1.0)] * 8), logits.argmax(-1))


def _draws(params: SamplingParams, probs: list[float], n: int = 4000) -> torch.Tensor:
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    return run(Sampler(torch.Generator().manual_seed(0)), logits, [params] * n)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.7), {0, 1}),  # mass before token 2 is 0.8 >= 0.7
        (SamplingParams(top_p=0.85), {0, 1, 2}),
        (SamplingParams(min_p=0.5), {0, 1}),  # threshold 0.25
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.1
        (SamplingParams(top_k=3, top_p=0.7), {0, 1}),
        (SamplingParams(temperature=0.5, top_k=3, min_p=0.3), {0, 1}),  # sharpened: 0.3^2/0.5^2 >= 0.3
    ],
)
def test_filters_restrict_support(params: SamplingParams, allowed: set[int]) -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    seen = set(_draws(params, probs).tolist())
    assert seen == allowed


@pytest.mark.parametrize("top_k", [-1, 40])  # full sort and the partial (topk) path
def test_filters_match_transformers_support(top_k: int) -> None:
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=0.9, min_p=0.02)
    row = torch.randn(1, 3000, generator=torch.Generator().manual_seed(4)) * 2
    ref = row
    warpers = [TemperatureLogitsWarper(0.8), TopPLogitsWarper(0.9), MinPLogitsWarper(0.02)]
    if top_k > 0:
        warpers.insert(1, TopKLogitsWarper(top_k))
    for warper in warpers:
        ref = warper(torch.zeros(1, 1, dtype=torch.long), ref)
    allowed = set(torch.isfinite(ref[0]).nonzero().flatten().tolist())
    n = 4000
    out = run(Sampler(torch.Generator().manual_seed(0)), row.expand(n, -1).contiguous(), [params] * n)
    seen = set(out.tolist())
    assert seen <= allowed and len(seen) >= 0.9 * len(allowed)


def test_filters_combine_per_row() -> None:
    # Different filters in one batch must not leak into each other's rows.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    n = 2000
    logits = probs.expand(3 * n, -1).contiguous()
    params = [SamplingParams(top_k=1)] * n + [SamplingParams(top_p=0.7)] * n + [SamplingParams()] * n
    out = run(Sampler(torch.Generator().manual_seed(1)), logits, params)
    assert set(out[:n].tolist()) == {0}
    assert set(out[n : 2 * n].tolist()) == {0, 1}
    assert set(out[2 * n :].tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("device", DEVICES)
def test_repetition_penalty_matches_transformers(device: str) -> None:
    logits = random_logits(3, 50, device, seed=2)
    prev = [[1, 4, 4, 7, 49], [0, 2, 3], [5]]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 3
    got = Sampler().apply_penalties(logits, SamplerInputs(params, prev, [0] * 3, [()] * 3, [None] * 3))
    for i in range(3):
        ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prev[i]]), logits[i : i + 1].cpu())
        assert torch.equal(got[i].cpu(), ref[0])
    assert torch.equal(run(Sampler(), logits, params, prev), got.argmax(-1))


def test_repetition_penalty_by_hand() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    params = [SamplingParams(repetition_penalty=2.0), SamplingParams()]
    got = Sampler().apply_penalties(logits, SamplerInputs(params, [[0, 1, 1], [0, 1]], [0, 0], [(), ()],
                                                            [None, None]))
    assert got.tolist() == [[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]]
    assert logits[0, 0] == 2.0  # the caller's tensor is not modified


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0, 3.0]]).expand(4, -1)
    eos = [(2,)] * 4
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=0, stop_token_ids=[3]),
    ]
    out = run(Sampler(), logits, params, num_out=[2, 3, 0, 0], eos=eos)
    # Row 0 is below min_tokens: eos (2) and the stop id (3) are banned; row 1 has reached it;
    # row 2 ignores eos so only the stop id is banned; row 3 has no minimum.
    assert out.tolist() == [4, 2, 2, 2]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_reproducible_across_batches(device: str) -> None:
    v = 1000
    flat = torch.zeros(1, v, device=device)  # uniform: every draw is informative
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def stream(batch: str) -> list[int]:
        gen = make_generator(seeded.seed, device)
        sampler = Sampler()
        tokens = []
        for step in range(12):
            if batch == "alone":
                params, gens, row = [seeded], [gen], 0
            else:
                other = make_generator(step, device)
                params = [SamplingParams(), seeded, SamplingParams(temperature=0.0), SamplingParams(seed=7)]
                gens, row = [None, gen, None, other], 1
            logits = flat.expand(len(params), -1).contiguous()
            tokens.append(int(run(sampler, logits, params, gens=gens)[row]))
        return tokens

    alone = stream("alone")
    assert alone == stream("alone")
    assert alone == stream("mixed")
    assert len(set(alone)) > 6


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)
    ga, gb = make_generator(1), make_generator(2)
    a = [int(run(Sampler(), logits, [SamplingParams()], gens=[ga])) for _ in range(5)]
    b = [int(run(Sampler(), logits, [SamplingParams()], gens=[gb])) for _ in range(5)]
    assert a != b
    assert make_generator(None) is None


def test_mixed_greedy_and_random_rows() -> None:
    logits = random_logits(6, 300, "cpu", seed=3)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(top_p=1e-6)]
    out = run(Sampler(torch.Generator().manual_seed(0)), logits, params)
    argmax = logits.argmax(-1)
    for i in (0, 1, 2, 4, 5):
        assert out[i] == argmax[i]
    assert 0 <= int(out[3]) < 300


def test_temperature_sampling_distribution() -> None:
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperature = 0.7
    n = 40000
    logits = base.expand(n, -1).contiguous()
    params = [SamplingParams(temperature=temperature)] * n
    out = run(Sampler(torch.Generator().manual_seed(123)), logits, params)
    counts = torch.bincount(out, minlength=6).double()
    expected = (base.double() / temperature).softmax(-1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0  # df=5: p ~ 1e-4; the stream is seeded, so this is deterministic anyway


def test_empty_batch() -> None:
    out = run(Sampler(), torch.zeros(0, 10), [])
    assert out.shape == (0,) and out.dtype == torch.int64


@pytest.mark.parametrize("device", DEVICES)
def test_near_zero_temperature_is_greedy(device: str) -> None:
    # validate() accepts any temperature > 0, but logits / 1e-39 overflow to inf, the softmax to NaN, and the
    # argmax of NaNs is token 0; such rows must decode greedily, alone and next to rows that really sample.
    row = torch.tensor([1.0, 5.0, 2.0, -3.0], device=device)
    tiny = [SamplingParams(temperature=t) for t in (1e-39, 1e-45, 1e-6)] + [SamplingParams(temperature=1e-39, seed=3)]
    assert all(p.greedy for p in tiny)
    gens = [make_generator(p.seed, device) for p in tiny]
    alone = run(Sampler(), row.expand(len(tiny), -1).contiguous(), tiny, gens=gens)
    assert alone.tolist() == [1] * len(tiny)
    mixed = [SamplingParams(temperature=0.8), tiny[0], SamplingParams(top_p=0.9, seed=5), tiny[1],
             SamplingParams(temperature=0.0), tiny[3]]
    gens = [make_generator(p.seed, device) for p in mixed]
    out = run(Sampler(torch.Generator(device).manual_seed(0)), row.expand(len(mixed), -1).contiguous(), mixed,
              gens=gens)
    assert out[[1, 3, 4, 5]].tolist() == [1, 1, 1, 1]
    assert ((out >= 0) & (out < 4)).all()


# One batch of rows that share nothing: each row's temperature, filters, repetition penalty and generator are
# its own. Seeded rows sit at 0 and 3 (not symmetric, so a reversed or shifted generator list is caught), greedy
# rows between them, an unseeded row (the shared RNG) last. Every penalty differs, so no single one fits all.
_PER_ROW_PARAMS = [
    SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.3, seed=11),
    SamplingParams(temperature=0.0, repetition_penalty=2.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.6, top_p=0.8, repetition_penalty=0.8, seed=22),
    SamplingParams(temperature=1.0, top_k=50, min_p=0.05, repetition_penalty=1.15),
]
# With the greedy rows sampling instead, the batch takes the all-random path (no index_select of rows).
_PER_ROW_PARAMS_ALL_RANDOM = [_PER_ROW_PARAMS[0], SamplingParams(temperature=1.2, repetition_penalty=2.0),
                              SamplingParams(temperature=0.9), *_PER_ROW_PARAMS[3:]]
# Row 1's greedy token is 7 (logit 5.0, already seen) unless its penalty of 2.0 pushes it below token 8 (3.5);
# 1.3, 1.15 or 0.8 in its place would leave 7 on top.
_PENALISED_TOKEN, _RUNNER_UP = 7, 8


def _per_row_step(step: int, vocab: int, device: str) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits of one step for the 5 rows above, and each row's previous tokens: the ten likeliest tokens, so
    that the repetition penalty moves a large share of the probability."""
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(100 + step)) * 1.5
    logits[1].clamp_(max=3.0)
    logits[1, _PENALISED_TOKEN], logits[1, _RUNNER_UP] = 5.0, 3.5
    prev = [logits[i].topk(10).indices.tolist() for i in range(5)]
    prev[1] = [_PENALISED_TOKEN, 3, 9]
    return logits.to(device), prev


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params", [_PER_ROW_PARAMS, _PER_ROW_PARAMS_ALL_RANDOM], ids=["mixed", "all_random"])
def test_each_row_of_a_batch_samples_as_if_alone(device: str, params: list[SamplingParams]) -> None:
    vocab, steps = 300, 16
    exact_rows = [i for i, p in enumerate(params) if p.greedy or p.seed is not None]
    batch_gens = [make_generator(p.seed, device) for p in params]
    alone_gens = [make_generator(p.seed, device) for p in params]  # same seeds, separate streams
    batch_sampler, alone_sampler = Sampler(torch.Generator(device).manual_seed(0)), Sampler()
    batched: list[list[int]] = []
    alone: list[list[int]] = []
    for step in range(steps):
        logits, prev = _per_row_step(step, vocab, device)
        batched.append(run(batch_sampler, logits, params, prev, gens=batch_gens).tolist())
        alone.append([int(run(alone_sampler, logits[i : i + 1], [params[i]], [prev[i]], gens=[alone_gens[i]]))
                      for i in exact_rows])
    for j, i in enumerate(exact_rows):
        assert [tokens[i] for tokens in batched] == [tokens[j] for tokens in alone], f"row {i}"
    for i, p in enumerate(params):
        if p.seed is not None:  # the seeded streams really vary, so they could tell generators apart
            assert len({tokens[i] for tokens in batched}) > steps // 2
    if params[1].greedy:
        assert all(tokens[1] == _RUNNER_UP for tokens in batched)


@pytest.mark.parametrize("device", DEVICES)
def test_temperature_applies_per_row(device: str) -> None:
    """Rows of one batch at different temperatures (and a greedy one) each follow their own softmax(logits / T).
    The shared generator is seeded, so the verdict is fixed; the bound (chi2 < 40 at df=5, p < 1e-7 for a
    correct sampler) is still far below what a wrong temperature gives (thousands at these counts)."""
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0])
    temperatures = [0.5, 0.0, 2.0, 1.0]
    n = 8000
    params = [SamplingParams(temperature=t) for t in temperatures] * n  # interleaved: row i has temperatures[i % 4]
    logits = base.to(device).expand(len(params), -1).contiguous()
    out = run(Sampler(torch.Generator(device).manual_seed(7)), logits, params).cpu()
    for j, temperature in enumerate(temperatures):
        tokens = out[j :: len(temperatures)]
        if temperature == 0.0:
            assert (tokens == int(base.argmax())).all()
            continue
        counts = torch.bincount(tokens, minlength=6).double()
        expected = (base.double() / temperature).softmax(-1) * n
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 40.0, (temperature, chi2)


@pytest.mark.parametrize(
    ("probs", "top_p", "num_kept"),
    [
        ([0.5, 0.25, 0.25], 0.75, 2),  # the mass of {0, one of the tied tokens} is exactly top_p
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.75, 2),  # the same, without a tie at the boundary
        ([0.5, 0.25, 0.125, 0.0625, 0.0625], 0.5, 1),  # the top token alone reaches top_p
    ],
)
def test_top_p_boundary_matches_transformers(probs: list[float], top_p: float, num_kept: int) -> None:
    """Top-p keeps the smallest prefix whose mass reaches top_p: a prefix whose mass equals top_p exactly is
    enough, the next token goes. Dyadic probabilities make the sums exact in float32."""
    logits = torch.tensor(probs).log()
    assert top_p in logits.softmax(-1).sort(descending=True).values.cumsum(-1).tolist()  # really on the boundary
    ref = TopPLogitsWarper(top_p)(torch.zeros(1, 1, dtype=torch.long), logits.unsqueeze(0))[0]
    kept = torch.isfinite(ref).nonzero().flatten().tolist()
    assert len(kept) == num_kept
    seen = set(_draws(SamplingParams(top_p=top_p), probs).tolist())
    # Which of two tied tokens is cut depends on the sort, in transformers as here: compare the kept probabilities.
    assert sorted(probs[i] for i in seen) == sorted(probs[i] for i in kept)
