"""Visual-token pruning strategies as pure functions of one image's embeddings (pool, divprune) or of the pixels
each token covers (dedup): the shared contract (sorted unique in-range indices, the counts, identity at keep 1.0,
determinism, bf16 = its float32 copy), what each strategy is for (pool spreads evenly, divprune covers every
cluster, dedup collapses flat regions and keeps detail), and the clear errors for bad settings."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from flashvlm.pruning.base import (
    InvalidKeepRatioError,
    PruningSettingError,
    TokenGrid,
    UnknownPruningStrategyError,
    kept_count,
    validate_keep_ratio,
)
from flashvlm.pruning.dedup import DedupStrategy
from flashvlm.pruning.registry import PRUNING_STRATEGIES, get_strategy
from flashvlm.pruning.setting import InvalidDedupThresholdError

EMBEDDING = ("none", "pool", "divprune")
PRUNING = ("pool", "divprune")
GRIDS = [TokenGrid(1, 27, 36), TokenGrid(1, 1, 50), TokenGrid(2, 6, 10), TokenGrid(1, 1, 1), TokenGrid(1, 13, 7)]
RATIOS = [1.0, 0.5, 0.25, 0.11, 0.01]


def _random(grid: TokenGrid, seed: int, dim: int = 64) -> torch.Tensor:
    return torch.randn(grid.num_tokens, dim, generator=torch.Generator().manual_seed(seed))


def test_registry_names_every_strategy() -> None:
    assert PRUNING_STRATEGIES == ("none", "pool", "divprune", "dedup")
    for name in PRUNING_STRATEGIES:
        assert get_strategy(name).name == name


@pytest.mark.parametrize("name", EMBEDDING)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_contract_sorted_unique_in_range_counts(name: str, grid: TokenGrid) -> None:
    strategy = get_strategy(name)
    for seed, ratio in enumerate(RATIOS):
        kept = strategy.select(_random(grid, seed), grid, ratio)
        assert kept.dtype == torch.int64 and kept.dim() == 1
        values = kept.tolist()
        assert values == sorted(set(values)), "indices must be sorted and unique"
        assert values[0] >= 0 and values[-1] < grid.num_tokens
        cap = kept_count(grid.num_tokens, ratio)
        assert len(values) == (grid.num_tokens if name == "none" else cap)
        assert strategy.planned_count(grid.num_tokens, ratio) == strategy.fewest_kept(grid, ratio) == len(values)


@pytest.mark.parametrize("name", EMBEDDING)
def test_keep_ratio_one_keeps_everything(name: str) -> None:
    for seed, grid in enumerate(GRIDS):
        kept = get_strategy(name).select(_random(grid, 100 + seed), grid, 1.0)
        assert torch.equal(kept, torch.arange(grid.num_tokens))


@pytest.mark.parametrize("name", PRUNING)
def test_deterministic_and_bf16_matches_its_float32_copy(name: str) -> None:
    grid = TokenGrid(1, 27, 36)
    embeddings = _random(grid, 7, dim=256).bfloat16()
    embeddings[: grid.num_tokens // 2] = embeddings[0]  # half the picture flat, the rest random
    for ratio in (0.5, 0.25, 0.11):
        first = get_strategy(name).select(embeddings, grid, ratio)
        assert torch.equal(first, get_strategy(name).select(embeddings.clone(), grid, ratio))
        # Similarities are computed in float32, so bf16 input chooses exactly what its float32 copy does.
        assert torch.equal(first, get_strategy(name).select(embeddings.float(), grid, ratio))


def test_pool_spreads_evenly() -> None:
    grid = TokenGrid(1, 27, 36)
    for ratio in (0.5, 0.25, 0.11):
        kept = get_strategy("pool").select(_random(grid, 1), grid, ratio)
        rows, cols = sorted(set((kept // grid.w).tolist())), sorted(set((kept % grid.w).tolist()))
        stride = math.ceil(1 / math.sqrt(ratio))
        for axis, size in ((rows, grid.h), (cols, grid.w)):
            edges = [axis[0] + 1, size - axis[-1]]  # first kept from the top/left, last kept to the bottom/right
            gaps = [b - a for a, b in zip(axis, axis[1:])]
            assert max(gaps + edges) <= stride + 1, (ratio, axis)
        # Each quadrant gets its share, within a few tokens.
        quadrants = torch.zeros(2, 2)
        for index in kept.tolist():
            row, col = divmod(index, grid.w)
            quadrants[int(row >= grid.h / 2), int(col >= grid.w / 2)] += 1
        share = torch.tensor([[13.5 * 18, 13.5 * 18]] * 2) / grid.num_tokens * kept.numel()
        assert (quadrants - share).abs().max() <= 0.1 * share.max() + 3, quadrants


def test_pool_ignores_content_and_its_cache_is_not_handed_out() -> None:
    grid = TokenGrid(1, 13, 7)
    first = get_strategy("pool").select(_random(grid, 1), grid, 0.3)
    expected = first.clone()
    first.zero_()  # a caller writing into its result must not change the next image's choice
    assert torch.equal(get_strategy("pool").select(_random(grid, 2), grid, 0.3), expected)


def _clusters(grid: TokenGrid, sizes: list[int], seed: int, dim: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens in raster order drawn from len(sizes) tight clusters, cluster c filling the next sizes[c] tokens
    (so the small clusters sit together in the last rows, where an even lattice can miss them)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(len(sizes), dim, generator=gen)
    labels = torch.cat([torch.full((size,), c) for c, size in enumerate(sizes)])
    assert labels.numel() == grid.num_tokens
    return centres[labels] + 0.05 * torch.randn(grid.num_tokens, dim, generator=gen), labels


def test_divprune_covers_every_cluster() -> None:
    grid = TokenGrid(1, 20, 20)
    sizes = [380, 8, 6, 4, 2]  # one big background cluster and four small objects in the last row
    embeddings, labels = _clusters(grid, sizes, seed=3)
    for ratio in (len(sizes) / grid.num_tokens, 0.05, 0.25):
        kept = get_strategy("divprune").select(embeddings, grid, ratio)
        assert set(labels[kept].tolist()) == set(range(len(sizes))), ratio
    # With exactly one token per cluster to spend, max-min picks one of each; pool misses small clusters.
    exact = get_strategy("divprune").select(embeddings, grid, len(sizes) / grid.num_tokens)
    assert sorted(labels[exact].tolist()) == list(range(len(sizes)))
    pooled = get_strategy("pool").select(embeddings, grid, len(sizes) / grid.num_tokens)
    assert set(labels[pooled].tolist()) != set(range(len(sizes)))


def test_divprune_with_exact_duplicates_never_repeats() -> None:
    grid = TokenGrid(1, 4, 5)
    embeddings = _random(TokenGrid(1, 1, 4), 5).repeat(5, 1)  # 4 distinct tokens, each 5 times
    kept = get_strategy("divprune").select(embeddings, grid, 0.5)
    assert kept.numel() == 10 and kept.unique().numel() == 10


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf"), "abc", "0.5", True, False, None])
def test_validate_keep_ratio_rejects(bad: object) -> None:
    with pytest.raises(InvalidKeepRatioError, match=r"mm_token_keep_ratio must be .*\(0, 1\]") as err:
        validate_keep_ratio(bad)
    assert repr(bad) in str(err.value)
    assert isinstance(err.value, ValueError) and isinstance(err.value, PruningSettingError)
    with pytest.raises(InvalidKeepRatioError):
        get_strategy("pool").select(torch.randn(4, 8), TokenGrid(1, 2, 2), bad)  # type: ignore[arg-type]


def test_validate_keep_ratio_accepts() -> None:
    assert validate_keep_ratio(1) == 1.0 and isinstance(validate_keep_ratio(1), float)
    assert validate_keep_ratio(0.25) == 0.25
    assert validate_keep_ratio(1e-9) == 1e-9


def test_kept_count() -> None:
    assert kept_count(2304, 0.25) == 576
    assert kept_count(2691, 0.25) == 673  # ceil
    assert kept_count(100, 0.07) == 7  # 100 * 0.07 is 7.000000000000001 in floats
    assert kept_count(10, 0.01) == 1  # at least one
    assert kept_count(1, 0.5) == 1
    assert kept_count(972, 1.0) == 972
    with pytest.raises(ValueError):
        kept_count(0, 0.5)
    with pytest.raises(InvalidKeepRatioError):
        kept_count(10, 2.0)


@pytest.mark.parametrize("bad", ["random", "", "POOL", None, 3])
def test_unknown_strategy_names_the_known_ones(bad: object) -> None:
    with pytest.raises(UnknownPruningStrategyError, match="none, pool, divprune, dedup") as err:
        get_strategy(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(err.value) and isinstance(err.value, ValueError)


def test_bad_inputs_and_parameters() -> None:
    with pytest.raises(ValueError, match="12 embeddings for a grid of 16"):
        get_strategy("pool").select(torch.randn(12, 8), TokenGrid(1, 4, 4), 0.5)
    with pytest.raises(ValueError, match=r"\(tokens, dim\)"):
        get_strategy("divprune").select(torch.randn(4, 4, 8), TokenGrid(1, 4, 4), 0.5)
    with pytest.raises(ValueError, match="TokenGrid.h"):
        TokenGrid(1, 0, 4)
    with pytest.raises(InvalidDedupThresholdError, match=r"\[0, 255\]"):
        get_strategy("dedup", threshold=300)
    with pytest.raises(ValueError, match="tile"):
        DedupStrategy(tile=0)
    with pytest.raises(ValueError, match="uint8"):
        DedupStrategy().select_pixels(torch.zeros(16, 12), TokenGrid(1, 4, 4), 0.5)
    with pytest.raises(ValueError, match="12 pixel blocks for a grid of 16"):
        DedupStrategy().select_pixels(torch.zeros(12, 12, dtype=torch.uint8), TokenGrid(1, 4, 4), 0.5)


def test_token_grid_from_patch_grid() -> None:
    grid = TokenGrid.from_patch_grid((1, 54, 72), 2)
    assert grid == TokenGrid(1, 27, 36) and grid.num_tokens == 972
    with pytest.raises(ValueError, match="not divisible"):
        TokenGrid.from_patch_grid((1, 5, 8), 2)


def test_names_and_counts_import_no_torch() -> None:
    code = ("import sys; from flashvlm.pruning.registry import PRUNING_STRATEGIES; "
            "from flashvlm.pruning.base import kept_count; kept_count(10, 0.5); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", PRUNING)
def test_cuda_agrees_with_cpu_and_syncs_only_where_documented(name: str) -> None:
    grid = TokenGrid(1, 20, 20)
    if name == "divprune":
        # CUDA's float32 matmul rounds differently, so near-ties may break the other way: compare what the
        # strategy is for (one token of every cluster), not the exact indices.
        embeddings, labels = _clusters(grid, [380, 8, 6, 4, 2], seed=3, dim=1024)
        ratio = 5 / grid.num_tokens
    else:
        embeddings, labels, ratio = _random(grid, 5, dim=1024), None, 0.25
    embeddings = embeddings.bfloat16()
    strategy = get_strategy(name)
    on_device = embeddings.cuda()
    strategy.select(on_device, grid, ratio)  # warm up: allocator, kernels, pool's pinned indices
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kept = strategy.select(on_device, grid, ratio)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert kept.device.type == "cuda" and kept.dtype == torch.int64
    kept = kept.cpu()
    assert kept.tolist() == sorted(set(kept.tolist()))
    if labels is None:
        assert torch.equal(kept, strategy.select(embeddings, grid, ratio))
    else:
        assert sorted(labels[kept].tolist()) == [0, 1, 2, 3, 4]
