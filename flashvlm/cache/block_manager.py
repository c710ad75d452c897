"""Paged KV-cache bookkeeping: which physical blocks each request owns, and prefix caching.

CPU-only. The runner owns the KV tensors; this module only hands out block ids. Blocks are
reference counted so that a full block can be shared between requests. With prefix caching on,
a block whose tokens are all computed gets a chain hash (cache/prefix_cache.py: tokens plus the
content hashes of images it holds) and enters `_cached_blocks` (hash -> block). A freed block keeps
its hash and goes to the end of the free list, so it can be revived by a later request with the
same prefix until allocation reaches it at the front of the list (LRU) and reuses it.

Invariants (check_invariants): a block has a hash iff the hash map points at it; ref_cnt equals
the number of tables holding it; ref_cnt == 0 iff it is on the free list; the in-flight counts are
those of the running requests' uncomputed prompt blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from flashvlm.cache.prefix_cache import PrefixCacheStats, extend_block_hashes
from flashvlm.request import Request

NULL_BLOCK_ID = 0
"""Reserved: never handed out, so padded block tables and slot mappings can point at it."""


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    """Chain hash of a full, computed block's contents; None = not reusable (partial, or a duplicate)."""


class BlockManager:
    """Hands out KV blocks to requests; all-or-nothing allocation, LRU-ordered free list."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        # Ordered oldest-freed first. An OrderedDict rather than a deque because a prefix-cache
        # hit must pull a free-but-cached block out of the middle in O(1).
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b.block_id != NULL_BLOCK_ID
        )
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Parallel int lists so building a step's block tables does not walk block objects.
        self._req_block_ids: dict[str, list[int]] = {}
        # Prefix-cache index: block_hash -> block holding that content. A block stays here while
        # free until it is reused for other content (see _take_free_block).
        self._cached_blocks: dict[int, KVBlock] = {}
        # Per request: chain hashes of its full blocks (kept across preemption: tokens never
        # change), and how many leading blocks of its current table are done hashing.
        self._req_hashes: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}
        # Blocks that running requests are about to compute: hash -> how many will. A waiting request whose
        # next blocks are among them can wait a step or two and then hit the cache instead of computing a copy.
        self._in_flight: dict[int, int] = {}
        # rid -> [first, end): the blocks of its hash chain (_req_hashes, which only grows) still in flight
        self._req_in_flight: dict[str, tuple[int, int]] = {}
        self.prefix_stats = PrefixCacheStats()
        self.num_evicted_blocks = 0
        """Cached blocks reused for other content (LRU eviction)."""

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks owned by some request (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix-cache index, held or free."""
        return len(self._cached_blocks)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int, prefix: Sequence[KVBlock] = ()) -> int:
        """Free-list blocks the request would take to hold num_tokens tokens of KV. With `prefix` (cached
        blocks for a request that owns none yet), free cached blocks among them count: taking them off
        the free list uses it up just as a fresh block does."""
        if prefix:
            return (self.blocks_for_tokens(num_tokens) - len(prefix)) + sum(1 for b in prefix if b.ref_cnt == 0)
        owned = len(self._req_blocks.get(request_id, ()))
        return max(0, self.blocks_for_tokens(num_tokens) - owned)

    def can_allocate(self, request_id: str, num_tokens: int, prefix: Sequence[KVBlock] = ()) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens, prefix) <= self.num_free_blocks

    def num_blocks_freed_by(self, request_id: str, exclude: Collection[KVBlock] = ()) -> int:
        """Blocks that would return to the free list if this request were freed (unshared ones),
        not counting those in `exclude`."""
        return sum(1 for b in self._req_blocks.get(request_id, ()) if b.ref_cnt == 1 and b not in exclude)

    # ---- allocation --------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int, prefix: Sequence[KVBlock] = ()) -> bool:
        """Grow the request's table to cover num_tokens tokens. False (and no change) if short.

        `prefix`: cached blocks (from find_cached_prefix) to share as the table's head; only for a
        request that owns no blocks yet, and num_tokens must reach past them (at least one token to
        compute, in a block of its own)."""
        if prefix:
            assert request_id not in self._req_blocks, f"{request_id}: prefix for a request that owns blocks"
            assert num_tokens > len(prefix) * self.block_size, "the last token must not land in a shared block"
        need = self.num_new_blocks_needed(request_id, num_tokens, prefix)
        if need == 0:
            return True
        if need > self.num_free_blocks:
            return False
        blocks = self._req_blocks.setdefault(request_id, [])
        ids = self._req_block_ids.setdefault(request_id, [])
        # Shared blocks first, so that taking fresh ones from the free list cannot evict them.
        for block in prefix:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1
            blocks.append(block)
            ids.append(block.block_id)
        if prefix:
            self._num_hashed[request_id] = len(prefix)
        for _ in range(self.blocks_for_tokens(num_tokens) - len(blocks)):
            block = self._take_free_block()
            block.ref_cnt = 1
            blocks.append(block)
            ids.append(block.block_id)
        return True

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks nobody else holds go to the free list's end.

        Blocks keep their hashes, so a later request (or this one, resumed after preemption) with the
        same prefix can revive them until they are reused."""
        blocks = self._req_blocks.pop(request_id, None)
        self._req_block_ids.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._settle_in_flight(request_id, None)
        if not blocks:
            return
        # Tail blocks first: a prompt's leading blocks are the likeliest to be reused, so they
        # should be the last to be evicted (LRU takes from the front).
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def forget(self, request_id: str) -> None:
        """The request is finished: drop its hash chain (free() keeps it for a preempted request)."""
        self.free(request_id)
        self._req_hashes.pop(request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (the live list keeps growing)."""
        return list(self._req_block_ids.get(request_id, ()))

    def blocks_of(self, request_id: str) -> list[KVBlock]:
        """A copy of the request's block list (to share its head with a request that owns none: allocate_slots'
        `prefix`)."""
        return list(self._req_blocks.get(request_id, ()))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._req_block_ids.get(request_id, ()))

    def _take_free_block(self) -> KVBlock:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            # Reusing a cached block for new content: its old content is gone.
            del self._cached_blocks[block.block_hash]
            block.block_hash = None
            self.num_evicted_blocks += 1
        return block

    # ---- prefix caching ----------------------------------------------------------------

    def find_cached_prefix(self, req: Request) -> list[KVBlock]:
        """The longest chain of cached blocks matching the head of req's known tokens; takes nothing.

        At most (num_tokens - 1) // block_size blocks: at least one token is left to compute (to
        sample from), and it lands in a block of its own, never in a shared one."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(self._req_hashes.setdefault(req.request_id, []), req, self.block_size,
                                     max_blocks)
        hit: list[KVBlock] = []
        for h in hashes[:max_blocks]:
            block = self._cached_blocks.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def cache_computed_blocks(self, req: Request) -> None:
        """Hash and index the request's blocks whose tokens are now all computed (call after
        num_computed_tokens moves). A block whose content is already cached elsewhere (two requests
        computed it at once) stays unhashed: it is freed as a plain block."""
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        full = req.num_computed_tokens // self.block_size
        done = self._num_hashed.get(rid, 0)
        if full <= done:
            return
        blocks = self._req_blocks[rid]
        hashes = extend_block_hashes(self._req_hashes.setdefault(rid, []), req, self.block_size, full)
        for i in range(done, full):
            block, h = blocks[i], hashes[i]
            if block.block_hash is None and h not in self._cached_blocks:
                block.block_hash = h
                self._cached_blocks[h] = block
        self._num_hashed[rid] = full
        self._settle_in_flight(rid, full)

    def mark_in_flight(self, req: Request, num_cached_blocks: int) -> None:
        """A request was admitted with `num_cached_blocks` from the cache: its other full prompt blocks (as far
        as find_cached_prefix hashed them) are in flight until computed or freed."""
        if not self.enable_prefix_caching:
            return
        self._settle_in_flight(req.request_id, None)
        chain = self._req_hashes.get(req.request_id, [])
        if num_cached_blocks >= len(chain):
            return
        self._req_in_flight[req.request_id] = (num_cached_blocks, len(chain))
        for h in chain[num_cached_blocks:]:
            self._in_flight[h] = self._in_flight.get(h, 0) + 1

    def num_in_flight_blocks(self, req: Request, first_block: int) -> int:
        """How many of req's blocks from `first_block` on, consecutively, a running request is computing now
        (req's chain as hashed by find_cached_prefix)."""
        n = 0
        for h in self._req_hashes.get(req.request_id, [])[first_block:]:
            if h not in self._in_flight:
                break
            n += 1
        return n

    def _settle_in_flight(self, request_id: str, done_blocks: int | None) -> None:
        """Release the request's in-flight blocks below `done_blocks` (computed), or all of them (None)."""
        entry = self._req_in_flight.get(request_id)
        if entry is None:
            return
        first, end = entry
        cut = end if done_blocks is None else max(first, min(end, done_blocks))
        for h in self._req_hashes[request_id][first:cut]:
            left = self._in_flight[h] - 1
            if left:
                self._in_flight[h] = left
            else:
                del self._in_flight[h]
        if cut == end:
            del self._req_in_flight[request_id]
        elif cut > first:
            self._req_in_flight[request_id] = (cut, end)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (benchmarks measuring a cold cache). Held blocks stay valid."""
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()

    @property
    def num_in_flight_hashes(self) -> int:
        """Distinct blocks running requests are computing that waiting ones may wait for (0 when idle: tests)."""
        return len(self._in_flight)

    # ---- checks ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests call this often)."""
        null = self.blocks[NULL_BLOCK_ID]
        assert null.ref_cnt == 0, "null block was handed out"
        assert NULL_BLOCK_ID not in self._free, "null block is on the free list"
        holders: dict[int, int] = {}
        for rid, blocks in self._req_blocks.items():
            ids = [b.block_id for b in blocks]
            assert ids == self._req_block_ids[rid], f"{rid}: block id list out of sync"
            assert len(set(ids)) == len(ids), f"{rid}: a block appears twice in one table"
            assert NULL_BLOCK_ID not in ids, f"{rid}: owns the null block"
            for bid in ids:
                holders[bid] = holders.get(bid, 0) + 1
        assert self._req_blocks.keys() == self._req_block_ids.keys()
        for block in self.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by {expected} requests")
            assert (block.ref_cnt == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} disagrees with free-list membership")
        for bid, block in self._free.items():
            assert block.block_id == bid and self.blocks[bid] is block
        for h, block in self._cached_blocks.items():
            assert block.block_hash == h, f"cached block {block.block_id}: hash {block.block_hash} != {h}"
        for block in self.blocks:
            assert block.block_hash is None or self._cached_blocks.get(block.block_hash) is block, (
                f"block {block.block_id} has a hash the index does not map to it")
        for rid, n in self._num_hashed.items():
            assert n <= len(self._req_blocks.get(rid, ())), f"{rid}: more blocks hashed than owned"
        assert len(self._free) + len(holders) == self.num_usable_blocks, "a block is lost"
        counts: dict[int, int] = {}
        for rid, (first, end) in self._req_in_flight.items():
            assert rid in self._req_blocks, f"{rid}: blocks in flight but it holds none"
            for h in self._req_hashes[rid][first:end]:
                counts[h] = counts.get(h, 0) + 1
        assert counts == self._in_flight, "in-flight block counts out of sync"
