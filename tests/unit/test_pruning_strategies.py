"""Visual-token pruning strategies as pure functions of one image's embeddings: the shared contract (sorted unique
in-range indices, the counts, identity at keep 1.0, determinism, bf16 = its float32 copy), what each strategy is
for (pool spreads evenly, divprune covers every cluster, dedup collapses flat regions and keeps detail), and the
clear errors for bad settings."""

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
from flashvlm.pruning.dedup import DEFAULT_THRESHOLD, DEFAULT_TILE, DedupStrategy
from flashvlm.pruning.registry import PRUNING_STRATEGIES, get_strategy

PRUNING = ("pool", "divprune", "dedup")
GRIDS = [TokenGrid(1, 27, 36), TokenGrid(1, 1, 50), TokenGrid(2, 6, 10), TokenGrid(1, 1, 1), TokenGrid(1, 13, 7)]
RATIOS = [1.0, 0.5, 0.25, 0.11, 0.01]


def _random(grid: TokenGrid, seed: int, dim: int = 64) -> torch.Tensor:
    return torch.randn(grid.num_tokens, dim, generator=torch.Generator().manual_seed(seed))


def _screenshot(height: int, width: int, centre: tuple[slice, slice], seed: int, dim: int = 64) -> torch.Tensor:
    """Wide flat margins (one embedding repeated) around a detailed centre (fresh random embeddings)."""
    gen = torch.Generator().manual_seed(seed)
    picture = torch.randn(dim, generator=gen).repeat(height, width, 1)
    rows, cols = centre
    picture[rows, cols] = torch.randn(rows.stop - rows.start, cols.stop - cols.start, dim, generator=gen)
    return picture.view(height * width, dim)


def test_registry_names_every_strategy() -> None:
    assert PRUNING_STRATEGIES == ("none", "pool", "divprune", "dedup")
    for name in PRUNING_STRATEGIES:
        assert get_strategy(name).name == name


@pytest.mark.parametrize("name", [*PRUNING_STRATEGIES])
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
        if name == "none":
            assert len(values) == grid.num_tokens
        elif name == "dedup":
            assert 1 <= len(values) <= cap
        else:
            assert len(values) == cap
        planned = strategy.planned_count(grid.num_tokens, ratio)
        assert planned == (None if name == "dedup" else len(values))


@pytest.mark.parametrize("name", PRUNING_STRATEGIES)
def test_keep_ratio_one_keeps_everything(name: str) -> None:
    # dedup at 1.0 is uncapped, not off: on content without near-duplicates (fresh random) it keeps everything.
    for seed, grid in enumerate(GRIDS):
        kept = get_strategy(name).select(_random(grid, 100 + seed), grid, 1.0)
        assert torch.equal(kept, torch.arange(grid.num_tokens))


@pytest.mark.parametrize("name", PRUNING)
def test_deterministic_and_bf16_matches_its_float32_copy(name: str) -> None:
    grid = TokenGrid(1, 27, 36)
    embeddings = _random(grid, 7, dim=256).bfloat16()
    # Half the picture flat, so dedup's threshold decides something; the rest random.
    embeddings[: grid.num_tokens // 2] = embeddings[0]
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


def test_dedup_screenshot_keeps_detail_and_few_margin_tokens() -> None:
    height, width = 36, 36
    centre = (slice(12, 24), slice(10, 26))  # 192 of 1,296 tokens are detail
    embeddings = _screenshot(height, width, centre, seed=11)
    kept = get_strategy("dedup").select(embeddings, TokenGrid(1, height, width), 1.0)
    grid_index = torch.arange(height * width).view(height, width)
    centre_tokens = set(grid_index[centre].flatten().tolist())
    assert centre_tokens <= set(kept.tolist())
    assert kept.numel() <= 0.30 * height * width
    # The margin collapses to at most one token per tile.
    assert kept.numel() - len(centre_tokens) <= math.ceil(height / DEFAULT_TILE) * math.ceil(width / DEFAULT_TILE)


def test_dedup_cap_keeps_the_most_distinctive() -> None:
    height, width = 36, 36
    centre = (slice(12, 24), slice(10, 26))
    embeddings = _screenshot(height, width, centre, seed=12)
    grid = TokenGrid(1, height, width)
    ratio = 150 / grid.num_tokens  # fewer than the 192 detail tokens may stay
    kept = get_strategy("dedup").select(embeddings, grid, ratio)
    assert kept.numel() == kept_count(grid.num_tokens, ratio)
    rows, cols = kept // width, kept % width
    assert bool(((rows >= 12) & (rows < 24) & (cols >= 10) & (cols < 26)).all()), "margin kept over detail"


def test_dedup_dense_picture_keeps_the_cap() -> None:
    grid = TokenGrid(1, 27, 36)
    for ratio in (1.0, 0.5, 0.25):
        kept = get_strategy("dedup").select(_random(grid, 21, dim=256), grid, ratio)
        assert kept.numel() == kept_count(grid.num_tokens, ratio)


def _noisy_flat(grid: TokenGrid, noise: float, seed: int, dim: int = 256) -> torch.Tensor:
    """One embedding plus independent noise per token: neighbours' cosine is about 1 / (1 + noise^2)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(dim, generator=gen) + noise * torch.randn(grid.num_tokens, dim, generator=gen)


def test_dedup_threshold_maps_to_kept_fraction() -> None:
    # How the threshold maps to the kept share: a flat region whose neighbours have cos ~0.99 (noise 0.1)
    # collapses to one token per tile at the default 0.95 and is kept whole at 0.999; a textured region (cos ~0.8,
    # noise 0.5) is kept at 0.95 and merges at 0.7; dense content (cos ~0) is kept at any of these.
    grid = TokenGrid(1, 24, 24)
    tiles = (24 // DEFAULT_TILE) ** 2
    assert DEFAULT_THRESHOLD == 0.95

    def fraction(embeddings: torch.Tensor, threshold: float | None = None) -> float:
        strategy = DedupStrategy() if threshold is None else DedupStrategy(threshold=threshold)
        return strategy.select(embeddings, grid, 1.0).numel() / grid.num_tokens

    flat, textured, dense = _noisy_flat(grid, 0.1, 1), _noisy_flat(grid, 0.5, 2), _random(grid, 3, dim=256)
    assert fraction(flat) == tiles / grid.num_tokens
    assert fraction(flat, 0.999) == 1.0
    assert fraction(textured) == 1.0
    assert fraction(textured, 0.7) == tiles / grid.num_tokens
    for threshold in (0.7, None, 0.999):
        assert fraction(dense, threshold) == 1.0


def test_dedup_tiles_stop_a_gradient_chaining_into_one_token() -> None:
    # Each token turns a little from its left neighbour (cos > 0.99) but the row ends orthogonal to its start.
    height, width = 8, 32
    angles = torch.linspace(0, math.pi / 2, width)
    row = torch.stack([angles.cos(), angles.sin()], dim=1)
    embeddings = torch.cat([row.repeat(height, 1), torch.zeros(height * width, 6)], dim=1)
    grid = TokenGrid(1, height, width)
    kept = get_strategy("dedup").select(embeddings, grid, 1.0)
    assert kept.numel() == (height // DEFAULT_TILE) * (width // DEFAULT_TILE)
    assert torch.equal(DedupStrategy(tile=1).select(embeddings, grid, 1.0), torch.arange(grid.num_tokens))


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
    with pytest.raises(ValueError, match="threshold"):
        get_strategy("dedup", threshold=1.5)
    with pytest.raises(ValueError, match="tile"):
        DedupStrategy(tile=0)


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
        embeddings, labels = _screenshot(20, 20, (slice(6, 14), slice(4, 16)), seed=5, dim=1024), None
        ratio = 0.5  # above dedup's survivors (96 detail tokens + a margin token per tile): no ranking at the cap
    embeddings = embeddings.bfloat16()
    strategy = get_strategy(name)
    on_device = embeddings.cuda()
    strategy.select(on_device, grid, ratio)  # warm up: allocator, kernels, pool's pinned indices
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("default" if name == "dedup" else "error")
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
