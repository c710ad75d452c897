"""CPU-side bookkeeping of the vision embeddings the runner holds, keyed by image content hash.

The runner stores one embedding tensor per mm_hash; this manager decides when it is computed
(first request that needs it) and when it may be dropped (no request needs it). Requests
sharing an image share the entry.

Lifecycle of an entry: referenced (some request still has to prefill over the image) ->
freeable (no users, but the runner still holds it; a new user revives it for free: a cache hit) ->
evicted (returned by `pop_freeable`, the scheduler tells the runner to drop it). `pop_freeable`
evicts least-recently-released freeable entries while the held tokens exceed `cache_tokens`.

Referenced entries are never evicted, even beyond the budget: a running request needs them for
its next chunks, and an image larger than the whole budget must still run. The budget bounds
what is kept for reuse, not what is in flight.
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
    def __init__(self, cache_tokens: int = 0) -> None:
        if cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0, got {cache_tokens}")
        self.cache_tokens = cache_tokens
        """Budget in embedding rows (image tokens) for entries no request references; 0 = no reuse."""
        self._num_tokens = 0
        self.num_hits = 0
        """A request took a reference on an embedding already held (or being encoded this step)."""
        self.num_misses = 0
        """A request needed an embedding that had to be encoded."""
        self.num_evictions = 0
        self._entries: dict[str, EncoderCacheEntry] = {}
        self._by_request: dict[str, set[str]] = {}
        # Entries with no users, oldest-released first: the order least-recently-used eviction takes.
        self._freeable: OrderedDict[str, None] = OrderedDict()

    # ---- queries -----------------------------------------------------------------------

    def needs_encode(self, mm_hash: str) -> bool:
        """True if the runner does not hold this embedding (nor will after this step's encodes)."""
        return mm_hash not in self._entries

    def holds(self, request_id: str, mm_hash: str) -> bool:
        """True if this request already references the embedding."""
        return mm_hash in self._by_request.get(request_id, ())

    def held_hashes(self) -> set[str]:
        """Every embedding the runner should hold after this step's frees and encodes."""
        return set(self._entries)

    def hashes_of(self, request_id: str) -> list[str]:
        return list(self._by_request.get(request_id, ()))

    @property
    def num_entries(self) -> int:
        """Embeddings the runner holds (referenced or freeable)."""
        return len(self._entries)

    @property
    def num_cached_tokens(self) -> int:
        """Embedding rows the runner holds (referenced or freeable)."""
        return self._num_tokens

    @property
    def hit_rate(self) -> float:
        n = self.num_hits + self.num_misses
        return self.num_hits / n if n else 0.0

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
            self._num_tokens += num_tokens
            self.num_misses += 1
        elif entry.num_tokens != num_tokens:
            raise ValueError(f"image {mm_hash}: {num_tokens} tokens, cached entry has {entry.num_tokens}")
        elif request_id not in entry.users:
            self.num_hits += 1
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

    def discard(self, mm_hash: str) -> None:
        """Forget an entry whose embedding was never made (its encode failed), with every reference to it: a
        request that still needs the image encodes it again."""
        entry = self._entries.get(mm_hash)
        if entry is None:
            return
        for request_id in list(entry.users):
            self.release(request_id, mm_hash)
        del self._freeable[mm_hash]  # the last release made it freeable
        self._num_tokens -= self._entries.pop(mm_hash).num_tokens

    def pop_freeable(self) -> list[str]:
        """Evict and return the embeddings the runner should drop now: least-recently-released
        unreferenced entries, until the held tokens fit the budget (or no unreferenced entry is left:
        referenced ones may exceed it, see the module docstring)."""
        evicted: list[str] = []
        while self._freeable and self._num_tokens > self.cache_tokens:
            mm_hash, _ = self._freeable.popitem(last=False)
            self._num_tokens -= self._entries.pop(mm_hash).num_tokens
            evicted.append(mm_hash)
        self.num_evictions += len(evicted)
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
        assert self._num_tokens == sum(e.num_tokens for e in self._entries.values()), "token count drifted"
