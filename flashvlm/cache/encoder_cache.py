"""CPU-side bookkeeping of the vision embeddings the runner holds, keyed by image content hash.

The runner stores one embedding tensor per mm_hash; this manager decides when it is computed
(first request that needs it) and when it may be dropped (no request needs it). Requests
sharing an image share the entry.

Lifecycle of an entry: referenced (some request still has to prefill over the image) ->
freeable (no users, but the runner still holds it; a new user revives it for free) -> evicted
(returned by `pop_freeable`, the scheduler tells the runner to drop it). Today every freeable
entry is evicted at the next step; issue 5 adds a token budget so `pop_freeable` evicts only
least-recently-used entries beyond the budget, turning freeable entries into a cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class EncoderCacheEntry:
    mm_hash: str
    num_tokens: int
    users: set[str] = field(default_factory=set)


class EncoderCacheManager:
    def __init__(self) -> None:
        self._entries: dict[str, EncoderCacheEntry] = {}
        self._by_request: dict[str, set[str]] = {}
        # Entries with no users, oldest-released first: the LRU order issue 5's eviction needs.
        self._freeable: OrderedDict[str, None] = OrderedDict()

    # ---- queries -----------------------------------------------------------------------

    def needs_encode(self, mm_hash: str) -> bool:
        """True if the runner does not hold this embedding (nor will after this step's encodes)."""
        return mm_hash not in self._entries

    def holds(self, request_id: str, mm_hash: str) -> bool:
        """True if this request already references the embedding."""
        return mm_hash in self._by_request.get(request_id, ())

    def hashes_of(self, request_id: str) -> list[str]:
        return list(self._by_request.get(request_id, ()))

    @property
    def num_entries(self) -> int:
        """Embeddings the runner holds (referenced or freeable)."""
        return len(self._entries)

    @property
    def num_cached_tokens(self) -> int:
        return sum(e.num_tokens for e in self._entries.values())

    @property
    def num_referenced(self) -> int:
        """Entries some request still needs."""
        return len(self._entries) - len(self._freeable)

    # ---- updates -----------------------------------------------------------------------

    def add(self, request_id: str, mm_hash: str, num_tokens: int) -> None:
        """Record that request_id needs mm_hash. New entries: the caller schedules the encode."""
        entry = self._entries.get(mm_hash)
        if entry is None:
            entry = self._entries[mm_hash] = EncoderCacheEntry(mm_hash, num_tokens)
        elif entry.num_tokens != num_tokens:
            raise ValueError(f"image {mm_hash}: {num_tokens} tokens, cached entry has {entry.num_tokens}")
        self._freeable.pop(mm_hash, None)
        entry.users.add(request_id)
        self._by_request.setdefault(request_id, set()).add(mm_hash)

    def release(self, request_id: str, mm_hash: str) -> list[str]:
        """Drop one request's reference. Returns [mm_hash] if nobody references it any more."""
        hashes = self._by_request.get(request_id)
        if hashes is None or mm_hash not in hashes:
            return []
        hashes.discard(mm_hash)
        if not hashes:
            del self._by_request[request_id]
        entry = self._entries[mm_hash]
        entry.users.discard(request_id)
        if entry.users:
            return []
        self._freeable[mm_hash] = None
        return [mm_hash]

    def release_all(self, request_id: str) -> list[str]:
        """Drop every reference of a finished, aborted or preempted request."""
        unreferenced: list[str] = []
        for mm_hash in sorted(self._by_request.get(request_id, ())):
            unreferenced += self.release(request_id, mm_hash)
        return unreferenced

    def pop_freeable(self) -> list[str]:
        """Evict and return the embeddings the runner should drop now (all unreferenced ones, for now)."""
        evicted = list(self._freeable)
        self._freeable.clear()
        for mm_hash in evicted:
            del self._entries[mm_hash]
        return evicted

    # ---- checks ------------------------------------------------------------------------

    def check_invariants(self) -> None:
        for rid, hashes in self._by_request.items():
            assert hashes, f"{rid}: empty reference set kept"
            for h in hashes:
                assert h in self._entries and rid in self._entries[h].users, f"{rid} -> {h} not mirrored"
        for h, entry in self._entries.items():
            for rid in entry.users:
                assert h in self._by_request.get(rid, ()), f"{h} -> {rid} not mirrored"
            assert (not entry.users) == (h in self._freeable), f"{h}: users/freeable disagree"
        assert all(h in self._entries for h in self._freeable)
