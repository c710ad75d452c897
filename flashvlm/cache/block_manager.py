"""Paged KV-cache bookkeeping: which physical blocks each request owns.

CPU-only. The runner owns the KV tensors; this module only hands out block ids. Blocks are
reference counted so that prefix caching (issue 5) can share a full block between requests:
a block's hash will chain over its tokens and the content hashes of images it holds, and
`_cached_blocks` will map hash -> block. Nothing here computes hashes yet.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK_ID = 0
"""Reserved: never handed out, so padded block tables and slot mappings can point at it."""


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    """Chain hash of a full block's contents, once prefix caching computes it; None = not reusable."""


class BlockManager:
    """Hands out KV blocks to requests; all-or-nothing allocation, LRU-ordered free list."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks: list[KVBlock] = [KVBlock(i) for i in range(num_blocks)]
        # Ordered oldest-freed first. An OrderedDict rather than a deque because a prefix-cache
        # hit must pull a free-but-cached block out of the middle in O(1).
        self._free: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks if b.block_id != NULL_BLOCK_ID
        )
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Parallel int lists so building a step's block tables does not walk block objects.
        self._req_block_ids: dict[str, list[int]] = {}
        # Prefix-cache index (issue 5): block_hash -> block holding that content. A block stays
        # here while free until it is reused for other content (see _take_free_block).
        self._cached_blocks: dict[int, KVBlock] = {}

    # ---- sizes -------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks owned by some request."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Blocks still to allocate so that the request holds num_tokens tokens of KV."""
        owned = len(self._req_blocks.get(request_id, ()))
        return max(0, self.blocks_for_tokens(num_tokens) - owned)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    def num_blocks_freed_by(self, request_id: str) -> int:
        """Blocks that would return to the free list if this request were freed (unshared ones)."""
        return sum(1 for b in self._req_blocks.get(request_id, ()) if b.ref_cnt == 1)

    # ---- allocation --------------------------------------------------------------------

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to cover num_tokens tokens. False (and no change) if short."""
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need == 0:
            return True
        if need > self.num_free_blocks:
            return False
        blocks = self._req_blocks.setdefault(request_id, [])
        ids = self._req_block_ids.setdefault(request_id, [])
        for _ in range(need):
            block = self._take_free_block()
            block.ref_cnt = 1
            blocks.append(block)
            ids.append(block.block_id)
        return True

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks nobody else holds go to the free list's end."""
        blocks = self._req_blocks.pop(request_id, None)
        self._req_block_ids.pop(request_id, None)
        if not blocks:
            return
        # Tail blocks first: with prefix caching, a prompt's leading blocks are the likeliest to
        # be reused, so they should be the last to be evicted (LRU takes from the front).
        for block in reversed(blocks):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (the live list keeps growing)."""
        return list(self._req_block_ids.get(request_id, ()))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._req_block_ids.get(request_id, ()))

    def _take_free_block(self) -> KVBlock:
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            # Reusing a cached block for new content: its old content is gone.
            if self._cached_blocks.get(block.block_hash) is block:
                del self._cached_blocks[block.block_hash]
            block.block_hash = None
        return block

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
        assert len(self._free) + len(holders) == self.num_usable_blocks, "a block is lost"
