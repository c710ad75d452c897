"""Prefix caching and the encoder-cache budget without a scheduler: hash chain, block sharing, LRU, leaks.

Scheduling with caching on is tested in test_scheduler_caching.py."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from test_scheduler import image

from flashvlm.cache.block_manager import BlockManager
from flashvlm.cache.encoder_cache import EncoderCacheManager
from flashvlm.cache.prefix_cache import block_mm_keys, extend_block_hashes, hash_block
from flashvlm.request import MMItem, Request, SamplingParams


def req_of(rid: str, tokens: list[int], mm: list[MMItem] | None = None, max_tokens: int = 4) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), mm_items=mm or [])


def chain(tokens: list[int], mm: list[MMItem] | None = None, bs: int = 4) -> list[int]:
    return extend_block_hashes([], req_of("x", tokens, mm), bs, len(tokens) // bs)


# ---- hash chain ------------------------------------------------------------------------------------

def test_hash_is_stable_across_processes() -> None:
    """blake2b, not Python's hash(): the same content hashes the same under any PYTHONHASHSEED."""
    code = ("from flashvlm.cache.prefix_cache import hash_block as h; "
            "print(h(h(None, [1, 2, 3, 4], [('img', 0, 1)]), [5, 6, 7, 8]))")
    outs = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    here = hash_block(hash_block(None, [1, 2, 3, 4], [("img", 0, 1)]), [5, 6, 7, 8])
    assert outs == {f"{here}\n"}


def test_hash_chain_determinism_and_sensitivity() -> None:
    tokens = list(range(10, 26))  # 4 blocks of 4
    base = chain(tokens, [image("A", 5, 6)])
    assert base == chain(tokens, [image("A", 5, 6)]) and len(set(base)) == 4
    # A token change alters its block and every later one (the chain), never the earlier ones.
    changed = chain(tokens[:9] + [999] + tokens[10:], [image("A", 5, 6)])
    assert changed[:2] == base[:2] and all(a != b for a, b in zip(changed[2:], base[2:]))
    # Another picture behind identical token ids: blocks from the image's first one on differ.
    other = chain(tokens, [image("B", 5, 6)])
    assert other[0] == base[0] and all(a != b for a, b in zip(other[1:], base[1:]))
    # The same picture one position later (same token ids): differs from the first block it touches.
    shifted = chain(tokens, [image("A", 6, 6)])
    assert shifted[0] == base[0] and shifted[1] != base[1]
    # Without the image, or with an image of the same hash but other offset inside the picture.
    assert chain(tokens)[1] != base[1]
    assert hash_block(None, [1, 2], [("A", 0, 0)]) != hash_block(None, [1, 2], [("A", 1, 0)])
    assert hash_block(None, [1, 2], [("A", 0, 0)]) != hash_block(None, [1, 2], [("A", 0, 1)])
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 2, 0])


def test_block_mm_keys_index_inside_image() -> None:
    items = [image("A", 2, 7), image("B", 9, 3)]  # A: [2, 9), B: [9, 12)
    assert block_mm_keys(items, 0, 4) == [("A", 0, 2)]
    assert block_mm_keys(items, 4, 8) == [("A", 2, 0)]
    assert block_mm_keys(items, 8, 12) == [("A", 6, 0), ("B", 0, 1)]
    assert block_mm_keys(items, 12, 16) == []


def test_chain_extends_incrementally_over_outputs() -> None:
    req = req_of("r", list(range(6)))
    hashes = extend_block_hashes([], req, 4, 1)
    req.output_token_ids += [7, 8, 9]
    assert extend_block_hashes(hashes, req, 4, 2) == chain(list(range(6)) + [7, 8], bs=4)


def test_chain_equals_hash_block_chained() -> None:
    """The batched chain (tokens packed once, sliced per block) hashes exactly what hash_block does, block by
    block, across images, the prompt's end and several extensions."""
    rng = random.Random(5)
    prompt = [rng.randrange(50_000) for _ in range(37)]
    items = [image("A", 3, 9), image("B", 14, 11)]
    req = req_of("r", prompt, items)
    hashes = extend_block_hashes([], req, 4, 5)
    req.output_token_ids += [rng.randrange(50_000) for _ in range(13)]
    extend_block_hashes(hashes, req, 4, 12)
    tokens = prompt + req.output_token_ids
    want, parent = [], None
    for i in range(12):
        parent = hash_block(parent, tokens[4 * i: 4 * i + 4], block_mm_keys(items, 4 * i, 4 * i + 4))
        want.append(parent)
    assert hashes == want


# ---- block manager ---------------------------------------------------------------------------------

def compute(bm: BlockManager, req: Request, upto: int) -> None:
    """Pretend the runner computed tokens up to `upto`, as the scheduler's update() records it."""
    req.num_computed_tokens = upto
    bm.cache_computed_blocks(req)


def test_share_full_blocks_and_ref_counts() -> None:
    bm = BlockManager(17, 4, enable_prefix_caching=True)
    a = req_of("a", list(range(14)))
    assert bm.find_cached_prefix(a) == []
    assert bm.allocate_slots("a", 14)
    compute(bm, a, 6)  # chunked: only block 0 is full
    assert bm.num_cached_blocks == 1
    compute(bm, a, 14)
    assert bm.num_cached_blocks == 3  # the partial 4th block is never hashed
    b = req_of("b", list(range(12)) + [99, 98])
    hit = bm.find_cached_prefix(b)
    assert [x.block_id for x in hit] == bm.get_block_ids("a")[:3]
    assert bm.allocate_slots("b", 14, hit)
    assert [x.ref_cnt for x in hit] == [2, 2, 2] and bm.get_block_ids("b")[:3] == bm.get_block_ids("a")[:3]
    bm.check_invariants()
    bm.forget("a")
    assert [x.ref_cnt for x in hit] == [1, 1, 1] and bm.num_free_blocks == 16 - 4
    bm.forget("b")
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3  # freed blocks stay cached
    bm.check_invariants()
    c = req_of("c", list(range(12)) + [5])
    hit = bm.find_cached_prefix(c)
    assert len(hit) == 3 and all(x.ref_cnt == 0 for x in hit)
    # Reviving 3 free cached blocks uses the free list as much as fresh blocks do.
    assert bm.num_new_blocks_needed("c", 13, hit) == 4 and bm.allocate_slots("c", 13, hit)
    assert bm.num_free_blocks == 12
    bm.check_invariants()


def test_hit_never_covers_the_whole_sequence() -> None:
    bm = BlockManager(9, 4, enable_prefix_caching=True)
    a = req_of("a", list(range(8)))
    bm.allocate_slots("a", 8)
    compute(bm, a, 8)
    bm.forget("a")
    # All 8 tokens are cached, but one must be computed to sample: the hit drops the last block.
    assert len(bm.find_cached_prefix(req_of("b", list(range(8))))) == 1
    assert len(bm.find_cached_prefix(req_of("c", list(range(9))))) == 2
    with pytest.raises(AssertionError):
        bm.allocate_slots("d", 8, bm.find_cached_prefix(req_of("c", list(range(9)))))


def test_duplicate_content_is_not_indexed_twice() -> None:
    bm = BlockManager(9, 4, enable_prefix_caching=True)
    a, b = req_of("a", list(range(5))), req_of("b", list(range(5)))
    bm.allocate_slots("a", 5)
    bm.allocate_slots("b", 5)  # both missed: admitted in the same step
    compute(bm, a, 5)
    compute(bm, b, 5)
    assert bm.num_cached_blocks == 1
    assert bm.blocks[bm.get_block_ids("b")[0]].block_hash is None
    bm.check_invariants()


def test_lru_eviction_order_and_reused_block_loses_hash() -> None:
    bm = BlockManager(7, 2, enable_prefix_caching=True)  # 6 usable blocks of 2 tokens
    reqs = [req_of(f"r{i}", [10 * i, 10 * i + 1, 10 * i + 2]) for i in range(3)]
    for r in reqs:
        bm.allocate_slots(r.request_id, 3)
        compute(bm, r, 3)
    for r in reqs:  # r0 freed first: least recently used
        bm.forget(r.request_id)
    assert bm.num_cached_blocks == 3
    # r0's cached block is revived: it leaves the free list and returns to its end when freed again.
    again = req_of("again", [0, 1, 2])
    hit = bm.find_cached_prefix(again)
    bm.allocate_slots("again", 3, hit)
    bm.forget("again")
    # Fresh allocations now evict r1's block first, then r2's, and r0's last.
    new = req_of("new", list(range(100, 108)))
    assert bm.allocate_slots("new", 8)  # 4 blocks: r1, r2's partials, then r1's and r2's cached blocks
    assert bm.find_cached_prefix(reqs[1]) == [] and bm.find_cached_prefix(reqs[2]) == []
    assert len(bm.find_cached_prefix(reqs[0])) == 1
    assert bm.num_evicted_blocks == 2
    bm.check_invariants()
    del new


def test_random_workload_no_leaks_and_hits_hold_their_content() -> None:
    """1,500 seeded operations on the block manager alone: admissions with lookups, chunked computing,
    preemption (free), finish (forget). A shadow copy of what each physical block holds checks that every
    hit block really holds the content its hash claims, and ref counts return to zero."""
    rng = random.Random(5)
    bs = 4
    bm = BlockManager(41, bs, enable_prefix_caching=True)
    stems = [[rng.randrange(50) for _ in range(rng.randint(4, 24))] for _ in range(5)]
    pool = {f"img{i}": 2 + 3 * i for i in range(4)}
    content: dict[int, int] = {}  # block id -> chain hash of what was written into it
    live: dict[str, Request] = {}
    n_ids = hits = 0
    for _ in range(1500):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = list(rng.choice(stems)) + [rng.randrange(50) for _ in range(rng.randint(0, 12))]
            items = []
            if rng.random() < 0.6:
                h = rng.choice(sorted(pool))
                off = rng.randint(0, len(tokens))
                items = [image(h, off, pool[h])]
                tokens += [7] * pool[h]
            req = req_of(f"q{n_ids}", tokens, items)
            n_ids += 1
            prefix = bm.find_cached_prefix(req)
            want = extend_block_hashes([], req, bs, len(prefix))
            assert [content[b.block_id] for b in prefix] == want, "a hit block holds other content"
            target = len(prefix) * bs + rng.randint(1, req.num_tokens - len(prefix) * bs)
            if bm.allocate_slots(req.request_id, target, prefix):
                req.num_computed_tokens = len(prefix) * bs
                hits += len(prefix)
                live[req.request_id] = req
        else:
            req = live[rng.choice(sorted(live))]
            if op < 0.75 and req.num_computed_tokens < req.num_tokens:
                target = min(req.num_tokens, req.num_computed_tokens + rng.randint(1, 9))
                if bm.allocate_slots(req.request_id, target):
                    chain_now = extend_block_hashes([], req, bs, target // bs)
                    ids = bm.get_block_ids(req.request_id)
                    for i in range(req.num_computed_tokens // bs, target // bs):
                        content[ids[i]] = chain_now[i]  # the runner writes these blocks
                    compute(bm, req, target)
                    if target == req.num_tokens:
                        req.output_token_ids.append(rng.randrange(50))
            elif op < 0.85:
                bm.free(req.request_id)  # preempted: recomputed later from a fresh lookup
                req.num_computed_tokens = 0
                del live[req.request_id]
            else:
                bm.forget(req.request_id)
                del live[req.request_id]
        bm.check_invariants()
    for rid in list(live):
        bm.forget(rid)
    bm.check_invariants()
    assert all(b.ref_cnt == 0 for b in bm.blocks) and bm.num_free_blocks == bm.num_usable_blocks
    assert hits > 100 and bm.num_evicted_blocks > 50


# ---- encoder cache budget --------------------------------------------------------------------------

def test_encoder_cache_lru_within_budget_and_counters() -> None:
    enc = EncoderCacheManager(cache_tokens=10)
    for rid, h in (("a", "X"), ("b", "Y"), ("c", "Z")):
        enc.add(rid, h, 4)
    assert (enc.num_misses, enc.num_hits, enc.num_cached_tokens) == (3, 0, 12)
    assert enc.pop_freeable() == []  # 12 > 10 but all referenced: nothing may go
    enc.release_all("b")
    enc.release_all("a")  # released order: Y, X
    assert enc.pop_freeable() == ["Y"] and enc.num_cached_tokens == 8
    enc.add("d", "X", 4)  # revived from the cache: a hit, no encode
    enc.add("d", "X", 4)  # a second chunk of the same request is no new hit
    assert not enc.needs_encode("X") and (enc.num_hits, enc.num_misses) == (1, 3)
    enc.release_all("c")
    enc.release_all("d")
    assert enc.pop_freeable() == [] and enc.held_hashes() == {"X", "Z"}
    enc.add("e", "W", 6)
    assert enc.pop_freeable() == ["Z"]  # least recently released first
    assert enc.num_evictions == 2
    enc.check_invariants()


def test_encoder_image_bigger_than_budget_still_held() -> None:
    enc = EncoderCacheManager(cache_tokens=5)
    enc.add("a", "BIG", 50)
    assert enc.pop_freeable() == [] and enc.num_cached_tokens == 50
    enc.release_all("a")
    assert enc.pop_freeable() == ["BIG"] and enc.num_cached_tokens == 0
    with pytest.raises(ValueError):
        EncoderCacheManager(-1)
