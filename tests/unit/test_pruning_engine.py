"""The engine's pruning pieces without a model: the options, a request's setting, the prefix cache's image key, and
the positions of kept tokens (M-RoPE and plain RoPE). End to end: tests/e2e/test_pruning.py."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from flashvlm.cache.prefix_cache import extend_block_hashes, hash_block, kv_image_key
from flashvlm.config import ConfigError, EngineConfig
from flashvlm.models.interfaces import VLModel
from flashvlm.models.qwen2_vl import mrope_positions
from flashvlm.options import add_engine_args
from flashvlm.pruning.base import InvalidKeepRatioError, PruningSettingError, TokenGrid
from flashvlm.pruning.setting import (
    DEFAULT_DEDUP_THRESHOLD,
    InvalidDedupThresholdError,
    PruningChoice,
    TokenPruning,
    pruning_for,
    resolve_setting,
)
from flashvlm.request import MMItem, Request, SamplingParams


def _config(**options) -> EngineConfig:
    return EngineConfig.from_options("unused", device="cpu", **options)


def test_options_default_to_off_and_validate() -> None:
    config = _config().validate()
    assert config.model.mm_token_pruning == "none" and config.model.mm_token_keep_ratio == 0.25
    assert config.model.mm_token_dedup_threshold == DEFAULT_DEDUP_THRESHOLD == 8.0
    assert _config(mm_token_pruning="dedup", mm_token_dedup_threshold=0).validate().model.mm_token_pruning == "dedup"
    assert _config(mm_token_pruning="divprune", mm_token_keep_ratio=1).validate().model.mm_token_keep_ratio == 1


@pytest.mark.parametrize(("options", "needle"), [
    ({"mm_token_dedup_threshold": -1}, "mm_token_dedup_threshold must be in [0, 255]"),
    ({"mm_token_dedup_threshold": 256}, "mm_token_dedup_threshold must be in [0, 255]"),
    ({"mm_token_dedup_threshold": "8"}, "mm_token_dedup_threshold must be a number"),
    ({"mm_token_pruning": "fastv"}, "unknown visual-token pruning strategy 'fastv'"),
    ({"mm_token_keep_ratio": 0}, "mm_token_keep_ratio must be in (0, 1]"),
    ({"mm_token_keep_ratio": 1.5}, "mm_token_keep_ratio must be in (0, 1]"),
    ({"mm_token_keep_ratio": float("nan")}, "mm_token_keep_ratio must be in (0, 1]"),
    ({"mm_token_keep_ratio": "0.5"}, "mm_token_keep_ratio must be a number"),
])
def test_bad_options_are_config_errors(options: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _config(**options).validate()
    assert needle in str(err.value)


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--mm-token-pruning", "dedup", "--mm-token-keep-ratio", "0.5",
                              "--mm-token-dedup-threshold", "4"])
    assert (args.mm_token_pruning, args.mm_token_keep_ratio, args.mm_token_dedup_threshold) == ("dedup", 0.5, 4)
    for bad in (["--mm-token-pruning", "fastv"], ["--mm-token-keep-ratio", "abc"],
                ["--mm-token-dedup-threshold", "abc"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_request_setting_overrides_the_engine_default() -> None:
    pool = PruningChoice("pool", 0.5)
    assert resolve_setting(pool, {}) == pool
    assert resolve_setting(pool, {"mm_token_keep_ratio": 0.25}) == PruningChoice("pool", 0.25)
    assert resolve_setting(PruningChoice("none", 0.25), {"mm_token_pruning": "divprune"}) == \
        PruningChoice("divprune", 0.25)
    assert resolve_setting(PruningChoice("none", 0.25), {"mm_token_pruning": "dedup", "mm_token_dedup_threshold": 3}) \
        == PruningChoice("dedup", 0.25, 3.0)
    with pytest.raises(InvalidKeepRatioError):
        resolve_setting(pool, {"mm_token_keep_ratio": None})
    with pytest.raises(PruningSettingError, match="unknown"):
        resolve_setting(pool, {"mm_token_pruning": {"name": "pool"}})
    for bad in (None, True, float("nan"), -0.5, 255.5, "4"):
        with pytest.raises(InvalidDedupThresholdError, match="mm_token_dedup_threshold"):
            resolve_setting(pool, {"mm_token_dedup_threshold": bad})  # checked whatever the strategy


def test_an_item_is_pruned_only_when_it_keeps_fewer_tokens() -> None:
    grid = TokenGrid(1, 4, 5)
    assert pruning_for(PruningChoice("none", 0.1), grid, 20) is None
    assert pruning_for(PruningChoice("pool", 1.0), grid, 20) is None
    assert pruning_for(PruningChoice("pool", 0.96), grid, 20) is None  # ceil(19.2) = 20: all of them
    setting = pruning_for(PruningChoice("divprune", 0.5), grid, 20)
    assert setting == TokenPruning("divprune", 0.5, grid) and setting.num_kept == 10
    with pytest.raises(PruningSettingError, match="no grid"):
        pruning_for(PruningChoice("pool", 0.5), None, 20)


def test_dedup_decides_from_pixels_when_the_item_is_made() -> None:
    grid = TokenGrid(1, 4, 5)
    flat = torch.full((20, 12), 200, dtype=torch.uint8)  # 20 tokens of 2 x 2 px, 3 channels, all equal
    choice = PruningChoice("dedup", 1.0)
    setting = pruning_for(choice, grid, 20, lambda: flat)
    assert setting is not None and setting.num_kept == 2  # one token per 4 x 4 tile
    assert setting.kept.tolist() == [0, 4] and not setting.kept.flags.writeable
    assert torch.equal(setting.select(torch.zeros(20, 3)), torch.tensor([0, 4]))
    noisy = torch.randint(0, 256, (20, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert pruning_for(choice, grid, 20, lambda: noisy) is None  # nothing merged: exactly the unpruned item
    capped = pruning_for(PruningChoice("dedup", 0.5), grid, 20, lambda: noisy)
    assert capped.num_kept == 10 and len(capped.kept) == 10
    with pytest.raises(PruningSettingError, match="no per-token pixels"):
        pruning_for(choice, grid, 20)
    # The key names the threshold (and the cap): two thresholds never share KV.
    keys = {pruning_for(PruningChoice("dedup", r, t), grid, 20, lambda: flat).key
            for r, t in ((1.0, 8.0), (1.0, 0.0), (0.5, 8.0))}
    assert len(keys) == 3 and all("dedup" in k for k in keys)
    assert TokenPruning("pool", 0.5, grid).key == "pool:0.5"


def _item(mm_hash: str, offset: int, full: int, pruning: TokenPruning | None = None) -> MMItem:
    kept = full if pruning is None else pruning.num_kept
    return MMItem(mm_hash=mm_hash, pixel_values=None, offset=offset, num_tokens=kept, pruning=pruning)


def test_prefix_key_names_the_setting_and_is_the_hash_alone_unpruned() -> None:
    grid = TokenGrid(1, 4, 4)
    tokens = [7] * 4 + [9] * 8 + [5] * 4  # 16 tokens, image at [4, 12) once pruned to half
    plain = _item("img", 4, 8)
    assert kv_image_key(plain) == "img"

    def chain(item: MMItem) -> list[int]:
        req = Request("r", tokens, SamplingParams(), mm_items=[item])
        return extend_block_hashes([], req, 4, 4)

    half, quarter = (_item("img", 4, 16, TokenPruning("pool", r, grid)) for r in (0.5, 0.25))
    quarter.num_tokens = 8  # same placeholder span as half: only the key tells them apart
    hashes = {name: chain(it) for name, it in (("plain", plain), ("half", half), ("quarter", quarter))}
    assert hashes["plain"][0] == hashes["half"][0] == hashes["quarter"][0]  # the text block before the image
    assert len({h[1] for h in hashes.values()}) == 3
    # The sweep is the chain of hash_block, pruned or not.
    for item in (plain, half):
        parent, expected = None, []
        for b in range(4):
            lo, hi = b * 4, b * 4 + 4
            keys = [(kv_image_key(item), max(lo, item.offset) - item.offset, max(lo, item.offset) - lo)] \
                if item.offset < hi and item.end > lo else []
            parent = hash_block(parent, tokens[lo:hi], keys)
            expected.append(parent)
        assert chain(item) == expected


def test_mrope_kept_tokens_keep_their_positions_and_text_after_does_not_move() -> None:
    rng = np.random.default_rng(0)
    t, gh, gw, offset, after = 1, 5, 3, 4, 6
    full, _ = mrope_positions(offset + gh * gw + after, [(offset, offset + gh * gw, t, gh, gw, "a")])
    for kept in (np.sort(rng.choice(gh * gw, 6, replace=False)), np.array([0, 1, 2]), np.array([14])):
        n = len(kept)
        length = offset + n + after
        got, delta = mrope_positions(length, [(offset, offset + n, t, gh, gw, "a")], {offset: kept})
        full_pos, full_delta = full.numpy(), mrope_positions(offset + gh * gw + after,
                                                            [(offset, offset + gh * gw, t, gh, gw, "a")])[1]
        np.testing.assert_array_equal(got[:, :offset], full_pos[:, :offset])
        np.testing.assert_array_equal(got[:, offset:offset + n], full_pos[:, offset + kept])
        np.testing.assert_array_equal(got[:, offset + n:], full_pos[:, offset + gh * gw:])
        # Generated token i (sequence index i) sits at i + delta: the same position as unpruned.
        assert length + delta == offset + gh * gw + after + full_delta
    # An image last in the prompt whose kept tokens miss its last rows: generation still resumes after the grid.
    _, delta = mrope_positions(offset + 2, [(offset, offset + 2, t, gh, gw, "a")], {offset: np.array([0, 1])})
    assert offset + 2 + delta == offset + max(gh, gw)
    with pytest.raises(ValueError, match="kept indices"):
        mrope_positions(offset + 3, [(offset, offset + 2, t, gh, gw, "a")], {offset: np.array([0, 1, 2])})


def test_plain_rope_kept_tokens_keep_their_positions() -> None:
    grid = TokenGrid(1, 3, 3)
    items = [_item("a", 2, 9, TokenPruning("pool", 0.34, grid)), _item("b", 8, 9)]  # 4 kept, then 9 unpruned
    items[1].offset = 2 + 4 + 2
    ids = list(range(2 + 4 + 2 + 9 + 3))
    model = VLModel.__new__(VLModel)  # prompt_positions reads no module state
    positions, delta = model.prompt_positions(ids, items, {0: np.array([0, 4, 5, 8])})
    expected = [0, 1, 2, 6, 7, 10, 11, 12, *range(13, 22), 22, 23, 24]
    assert positions.tolist() == expected and delta == 5
    unpruned, zero = model.prompt_positions(ids, [_item("b", 8, 9)])
    assert unpruned.tolist() == ids and zero == 0


def test_log_token_counts_give_each_kept_token_the_dropped_ones_nearest_it() -> None:
    from flashvlm.runner.pruned_tokens import log_token_counts

    # Tokens 0 and 2 lie near kept token 1, tokens 3 and 5 near kept token 4 (cosine), token 6 repeats token 1.
    emb = torch.tensor([[1.0, 0.1], [1.0, 0.0], [0.9, -0.1], [0.1, 1.0], [0.0, 1.0], [-0.1, 0.8], [2.0, 0.0]])
    kept = torch.tensor([1, 4, 6])
    counts = log_token_counts(emb, kept).exp().round()
    # 6 repeats 1 (the same direction): each kept token counts itself; the dropped ones go to the first of a tie.
    assert counts.tolist() == [3.0, 3.0, 1.0]
    assert counts.sum().item() == emb.shape[0]
