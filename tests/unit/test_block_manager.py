"""cache/ bookkeeping: BlockManager (paged KV blocks) and EncoderCacheManager (no torch, no model)."""

from __future__ import annotations

import random

import pytest

from flashvlm.cache.block_manager import NULL_BLOCK_ID, BlockManager
from flashvlm.cache.encoder_cache import EncoderCacheManager


def test_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        BlockManager(1, 16)


def test_blocks_cover_ceil_of_tokens() -> None:
    bm = BlockManager(10, 4)
    assert bm.allocate_slots("a", 1)
    assert len(bm.get_block_ids("a")) == 1
    assert bm.allocate_slots("a", 4)
    assert len(bm.get_block_ids("a")) == 1
    assert bm.allocate_slots("a", 5)
    assert len(bm.get_block_ids("a")) == 2
    # Asking for fewer tokens than already covered never shrinks the table.
    assert bm.allocate_slots("a", 2)
    assert len(bm.get_block_ids("a")) == 2
    assert bm.num_free_blocks == 9 - 2
    bm.check_invariants()


def test_null_block_never_handed_out() -> None:
    bm = BlockManager(6, 2)
    assert bm.num_usable_blocks == 5
    assert bm.allocate_slots("a", 10)
    ids = bm.get_block_ids("a")
    assert sorted(ids) == [1, 2, 3, 4, 5]
    assert NULL_BLOCK_ID not in ids
    assert bm.num_free_blocks == 0
    assert bm.usage == 1.0
    assert not bm.allocate_slots("b", 1)
    bm.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(5, 4)  # 4 usable
    assert bm.allocate_slots("a", 8)  # 2 blocks
    assert bm.allocate_slots("b", 4)  # 1 block
    before = bm.get_block_ids("a")
    assert not bm.can_allocate("a", 16)
    assert not bm.allocate_slots("a", 16)  # needs 2 more, only 1 free
    assert bm.get_block_ids("a") == before
    assert bm.num_free_blocks == 1
    assert not bm.allocate_slots("c", 5)
    assert bm.get_block_ids("c") == []
    assert bm.can_allocate("a", 12)
    assert bm.allocate_slots("a", 12)
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_get_block_ids_is_a_copy() -> None:
    bm = BlockManager(5, 4)
    bm.allocate_slots("a", 4)
    ids = bm.get_block_ids("a")
    bm.allocate_slots("a", 8)
    assert len(ids) == 1
    assert len(bm.get_block_ids("a")) == 2


def test_free_returns_blocks_lru_order() -> None:
    bm = BlockManager(7, 1)  # 6 usable blocks, one token each
    bm.allocate_slots("a", 3)
    bm.allocate_slots("b", 3)
    a_ids, b_ids = bm.get_block_ids("a"), bm.get_block_ids("b")
    assert bm.usage == 1.0
    bm.free("a")
    bm.free("b")
    assert bm.usage == 0.0
    assert bm.get_block_ids("a") == []
    # Freed blocks join the end of the free list: a's (freed first) come back first,
    # each table tail-first so a prompt's leading blocks are evicted last.
    bm.allocate_slots("c", 6)
    assert bm.get_block_ids("c") == a_ids[::-1] + b_ids[::-1]
    bm.check_invariants()


def test_free_unknown_request_is_noop() -> None:
    bm = BlockManager(4, 4)
    bm.free("nobody")
    assert bm.num_free_blocks == 3
    bm.check_invariants()


def test_usage_fraction() -> None:
    bm = BlockManager(11, 4)  # 10 usable
    bm.allocate_slots("a", 12)
    assert bm.usage == pytest.approx(0.3)
    assert bm.num_blocks_freed_by("a") == 3
    assert bm.num_new_blocks_needed("a", 20) == 2


def test_check_invariants_catches_corruption() -> None:
    bm = BlockManager(5, 4)
    bm.allocate_slots("a", 8)
    bm.check_invariants()
    bm.blocks[bm.get_block_ids("a")[0]].ref_cnt = 2
    with pytest.raises(AssertionError, match="ref_cnt"):
        bm.check_invariants()


def test_check_invariants_catches_lost_block() -> None:
    bm = BlockManager(5, 4)
    bm._free.popitem()
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_no_leaks_after_random_alloc_free() -> None:
    rng = random.Random(1234)
    bm = BlockManager(65, 4)
    shadow: dict[str, int] = {}  # request -> blocks we expect it to own
    failures = successes = 0
    for op in range(1000):
        rid = f"r{rng.randrange(20)}"
        if rng.random() < 0.35 and shadow:
            victim = rng.choice(sorted(shadow))
            bm.free(victim)
            del shadow[victim]
        else:
            tokens = rng.randint(1, 64)
            need = max(0, -(-tokens // 4) - shadow.get(rid, 0))
            free_before = bm.num_free_blocks
            ok = bm.allocate_slots(rid, tokens)
            assert ok == (need <= free_before), f"op {op}: got {ok}, need {need}, free {free_before}"
            if ok:
                successes += 1
                shadow[rid] = max(shadow.get(rid, 0), -(-tokens // 4))
                assert bm.num_free_blocks == free_before - need
            else:
                failures += 1
                assert bm.num_free_blocks == free_before
        for r, n in shadow.items():
            assert len(bm.get_block_ids(r)) == n
        assert bm.num_free_blocks == 64 - sum(shadow.values())
        bm.check_invariants()
    # The workload must have exercised both paths, or it proves little.
    assert failures > 20 and successes > 200
    for rid in list(shadow):
        bm.free(rid)
    assert bm.num_free_blocks == 64
    assert bm.usage == 0.0
    bm.check_invariants()


def test_encoder_cache_manager_refcounts() -> None:
    enc = EncoderCacheManager()
    assert enc.needs_encode("h")
    enc.add("a", "h", 5)
    enc.add("b", "h", 5)
    assert not enc.needs_encode("h") and enc.num_entries == 1 and enc.num_cached_tokens == 5
    assert enc.release("a", "h") == []
    assert enc.release("a", "h") == []  # double release is harmless
    assert enc.release_all("b") == ["h"]
    enc.add("c", "h", 5)  # revived before eviction: still held, no re-encode
    assert enc.pop_freeable() == [] and not enc.needs_encode("h")
    assert enc.release_all("c") == ["h"]
    assert enc.pop_freeable() == ["h"] and enc.needs_encode("h") and enc.num_entries == 0
    with pytest.raises(ValueError):
        enc.add("d", "z", 3)
        enc.add("e", "z", 4)
    enc.check_invariants()


def test_encoder_cache_discard_forgets_an_entry_and_its_references() -> None:
    enc = EncoderCacheManager(cache_tokens=100)
    enc.add("a", "h", 5)
    enc.add("b", "h", 5)
    enc.add("b", "g", 7)
    enc.discard("h")  # its encode failed: nobody holds it
    enc.check_invariants()
    assert enc.needs_encode("h") and enc.num_cached_tokens == 7 and enc.hashes_of("a") == []
    assert enc.hashes_of("b") == ["g"]
    assert enc.release_all("a") == [] and enc.release_all("b") == ["g"]  # aborting its users still works
    enc.discard("missing")
    enc.check_invariants()
