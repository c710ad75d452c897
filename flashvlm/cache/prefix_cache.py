"""Image-aware hash chain for prefix caching: which full KV blocks hold the same content.

A full block's hash covers its parent block's hash (so a hash names the whole prefix up to the
block's end), its token ids, and for each image whose placeholder range overlaps the block the
triple (mm_hash, index within the image of the block's first placeholder of it, position of that
placeholder within the block). Two different pictures behind the same placeholder token ids
therefore never share KV, and the same picture at another prompt position shares nothing past
the point where the token prefixes differ. (The in-block position is redundant when placeholders
have their own token id, as in every supported model; it keeps the hash exact without relying on it.)

Hashes are blake2b digests (stable across processes, unlike Python's randomized hash()), used
as 128-bit ints. CPU-only, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from flashvlm.request import MMItem, Request

_ROOT = b"flashvlm-kv-v1".ljust(16, b"\0")
"""Parent of the first block; bump the version if the hashed layout changes."""

MMKey = tuple[str, int, int]
"""(mm_hash, index within the image of the block's first placeholder of it, its position in the block)."""


def hash_block(parent: int | None, token_ids: Sequence[int], mm_keys: Sequence[MMKey] = ()) -> int:
    """Chain hash of one full block. Every variable-size field is length-prefixed."""
    h = hashlib.blake2b(digest_size=16)
    h.update(_ROOT if parent is None else parent.to_bytes(16, "little"))
    h.update(len(token_ids).to_bytes(4, "little"))
    h.update(array("q", token_ids).tobytes())
    for mm_hash, index, pos in mm_keys:
        raw = mm_hash.encode()
        h.update(len(raw).to_bytes(4, "little"))
        h.update(raw)
        h.update(index.to_bytes(8, "little"))
        h.update(pos.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def block_mm_keys(items: Sequence[MMItem], start: int, end: int) -> list[MMKey]:
    """Keys of the images overlapping token range [start, end), in prompt order."""
    return [(it.mm_hash, max(start, it.offset) - it.offset, max(start, it.offset) - start) for it in items
            if it.num_tokens > 0 and it.offset < end and it.end > start]


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output without concatenating the whole sequence."""
    prompt, n = req.prompt_token_ids, req.num_prompt_tokens
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return req.output_token_ids[start - n:end - n]
    return prompt[start:] + req.output_token_ids[:end - n]


def extend_block_hashes(hashes: list[int], req: Request, block_size: int, num_blocks: int) -> list[int]:
    """Grow `hashes` (the request's chain so far) in place to cover its first num_blocks full blocks.

    The request's tokens never change once known (prompt, then sampled outputs), so a chain computed
    once stays valid across steps and preemptions; callers pass num_blocks <= num_tokens // block_size.
    """
    if len(hashes) >= num_blocks:
        return hashes
    items = sorted((it for it in req.mm_items if it.num_tokens > 0), key=lambda it: it.offset)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        parent = hash_block(parent, _tokens(req, start, end), block_mm_keys(items, start, end) if items else ())
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Counted once per admission (a new request, or a preempted one resuming), in tokens."""

    queries: int = 0
    """Known tokens of admitted requests."""
    hits: int = 0
    """Of those, tokens whose KV came from cached blocks."""
    num_lookups: int = 0
    num_lookups_hit: int = 0
    """Admissions that reused at least one block."""

    def record(self, queried: int, hit: int) -> None:
        self.queries += queried
        self.hits += hit
        self.num_lookups += 1
        self.num_lookups_hit += hit > 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
