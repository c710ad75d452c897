"""The cache-aware choice of a replica, as plain Python (router.py feeds it Ray Serve's replicas and loads).

The router remembers, for each routing key it has seen (keys.py: prefix blocks and image hashes), the replica the
last request carrying that key went to: an LRU table of at most `max_keys` keys, each mapped to a replica id (a
short string), so its memory is bounded by the key count whatever the traffic. Keys of a replica that is gone are
ignored when looked up and age out of the table.

A request prefers, in order: the replica holding its longest known prompt prefix (its KV blocks, images inside
them included), else the one holding most of its images (their vision embeddings), else none. The preferred
replica takes it unless its load (requests routed to it and not finished) is more than `max_imbalance` above the
least-loaded replica's: then it falls back to the others, least loaded first, and the keys move with it, so a hot
image spreads over replicas instead of piling onto one. A request with no known key goes to the least loaded.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flashvlm.server.ray_serve.keys import NO_KEYS, RoutingKeys

DECISIONS = ("prefix_hit", "image_hit", "fallback", "least_loaded", "pinned")
"""What a routed request's choice was, as the router's metric labels it."""


@dataclass
class RouteTicket:
    """What the ingress tells the router about one request, and what the router answers, in one object: the router
    runs in the ingress's process and sees this very object among the request's arguments."""

    keys: RoutingKeys = NO_KEYS
    exclude: tuple[str, ...] = ()
    """Replicas this request already failed on (lost): not chosen again while another one is there."""
    pin: str | None = None
    """Send to this replica only (the ingress collecting every replica's /metrics)."""
    # Written by the router:
    preferred: str | None = None
    reason: str | None = None
    """Why `preferred` was preferred: "prefix" or "image"."""
    replica: str | None = None
    """The replica the request was sent to."""
    known_replicas: list[str] = field(default_factory=list)
    """The replicas the router could route to when it routed this request."""

    def decision(self) -> str:
        """One of DECISIONS, once the request was routed."""
        if self.pin is not None:
            return "pinned"
        if self.preferred is None:
            return "least_loaded"
        return f"{self.reason}_hit" if self.replica == self.preferred else "fallback"


class AffinityTable:
    """Routing key -> the replica id that last served it; least recently used keys forgotten past `max_keys`."""

    def __init__(self, max_keys: int) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self.max_keys = max_keys
        self._owner: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def owner(self, key: int) -> str | None:
        return self._owner.get(key)

    def remember(self, keys: RoutingKeys, replica: str) -> None:
        for key in (*keys.prefix, *keys.images):
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)

    def preferred(self, keys: RoutingKeys, live: Iterable[str]) -> tuple[str, str] | None:
        """(replica, "prefix" | "image") for these keys among the `live` replicas, or None."""
        alive = set(live)
        for key in reversed(keys.prefix):  # the longest known prefix first
            replica = self._owner.get(key)
            if replica in alive:
                return replica, "prefix"
        counts: dict[str, int] = {}
        for key in keys.images:
            replica = self._owner.get(key)
            if replica in alive:
                counts[replica] = counts.get(replica, 0) + 1
        if counts:
            return max(counts, key=lambda r: counts[r]), "image"  # ties: the first image's replica (dict order)
        return None


def rank_replicas(ticket: RouteTicket, loads: Mapping[str, int | None], table: AffinityTable,
                  max_imbalance: int, rng: random.Random | None = None) -> list[list[str]]:
    """Ranks of replica ids for Serve to try in turn (it takes the least loaded replica of the first rank that
    has room; equal loads: the first listed, so they are listed in random order); sets `ticket.preferred` and
    `ticket.reason`. `loads`: every routable replica -> its requests routed and not finished (None: not known;
    counted as 0)."""
    ticket.preferred = ticket.reason = None
    if ticket.pin is not None:
        return [[ticket.pin]] if ticket.pin in loads else []
    candidates = [r for r in loads if r not in ticket.exclude] or list(loads)
    if not candidates:
        return []
    (rng or random).shuffle(candidates)
    load = {r: loads[r] or 0 for r in candidates}
    found = table.preferred(ticket.keys, candidates)
    if found is None:
        return [sorted(candidates, key=lambda r: load[r])]
    ticket.preferred, ticket.reason = found
    others = sorted((r for r in candidates if r != ticket.preferred), key=lambda r: load[r])
    if others and load[ticket.preferred] - load[others[0]] > max_imbalance:
        return [others, [ticket.preferred]]
    return [[ticket.preferred], others] if others else [[ticket.preferred]]
