"""Image-aware hash chain for prefix caching: which full KV blocks hold the same content.

A full block's hash covers its parent block's hash (so a hash names the whole prefix up to the
block's end), its token ids, and for each image whose placeholder range overlaps the block the
triple (mm_hash, index within the image of the block's first placeholder of it, position of that
placeholder within the block). A pruned image's key also names its pruning setting (`kv_image_key`), so two
settings of one picture never share KV; unpruned, the key is the mm_hash alone. Two different pictures behind
the same placeholder token ids therefore never share KV, and the same picture at another prompt position
shares nothing past the point where the token prefixes differ. (The in-block position is redundant when placeholders
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
"""(kv_image_key, index within the image of the block's first placeholder of it, its position in the block)."""


def kv_image_key(item: MMItem) -> str:
    """What names an image's KV: its content hash, and for a pruned item the pruning setting, whose kept tokens
    are other embeddings at other positions."""
    return item.mm_hash if item.pruning is None else f"{item.mm_hash}|pruned:{item.pruning.key}"


def hash_block(parent: int | None, token_ids: Sequence[int], mm_keys: Sequence[MMKey] = ()) -> int:
    """Chain hash of one full block. Every variable-size field is length-prefixed. With `block_mm_keys`, the
    definition of the chain: `extend_block_hashes` computes the same digests in one sweep (the hot path), and
    the tests check it against these, as a kernel is checked against its reference."""
    parent_bytes = _ROOT if parent is None else parent.to_bytes(16, "little")
    keys = [(_mm_prefix(mm_hash), index, pos) for mm_hash, index, pos in mm_keys]
    digest = _block_digest(parent_bytes, len(token_ids).to_bytes(4, "little"), array("q", token_ids).tobytes(), keys)
    return int.from_bytes(digest, "little")


def _mm_prefix(mm_hash: str) -> bytes:
    raw = mm_hash.encode()
    return len(raw).to_bytes(4, "little") + raw


def _block_digest(parent: bytes, length: bytes, token_bytes: bytes | memoryview,
                  mm_keys: Sequence[tuple[bytes, int, int]]) -> bytes:
    """mm_keys: (the image's length-prefixed hash, index, pos) of each overlapping image. One joined buffer,
    one blake2b call: per-field update() calls cost more than the hashing at ~65 blocks a prompt."""
    parts = [parent, length, token_bytes]
    for prefix, index, pos in mm_keys:
        parts += (prefix, index.to_bytes(8, "little"), pos.to_bytes(8, "little"))
    return hashlib.blake2b(b"".join(parts), digest_size=16).digest()


def block_mm_keys(items: Sequence[MMItem], start: int, end: int) -> list[MMKey]:
    """Keys of the images overlapping token range [start, end), in prompt order."""
    return [(kv_image_key(it), max(start, it.offset) - it.offset, max(start, it.offset) - start) for it in items
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
    Equal to chaining `hash_block`; the new blocks' tokens are packed to bytes in one call and sliced, since
    a request's first admission hashes ~65 blocks (1,038 tokens) on the path to its first token.
    """
    first = len(hashes)
    if first >= num_blocks:
        return hashes
    # Images in prompt order (their placeholder ranges never overlap), with their hashes' bytes made once.
    items = sorted((it.offset, it.end, _mm_prefix(kv_image_key(it))) for it in req.mm_items if it.num_tokens > 0)
    token_bytes = memoryview(array("q", _tokens(req, first * block_size, num_blocks * block_size)).tobytes())
    width, length = block_size * 8, block_size.to_bytes(4, "little")
    parent = _ROOT if not hashes else hashes[-1].to_bytes(16, "little")
    k = 0  # the first image that does not end before the current block
    for i in range(first, num_blocks):
        start, end = i * block_size, (i + 1) * block_size
        while k < len(items) and items[k][1] <= start:
            k += 1
        keys = []
        for offset, _end, prefix in items[k:]:
            if offset >= end:
                break
            first_placeholder = max(start, offset)
            keys.append((prefix, first_placeholder - offset, first_placeholder - start))
        j = i - first
        parent = _block_digest(parent, length, token_bytes[j * width:(j + 1) * width], keys)
        hashes.append(int.from_bytes(parent, "little"))
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
