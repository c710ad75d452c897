"""`CacheAffinityRouter`: Ray Serve's request-router interface over affinity.py's choice.

Serve builds one router per handle (here: in the ingress's process, for its handle to the engine deployment) and
calls `choose_replicas` for each request until a replica accepts it; `on_request_routed` tells us which one did,
which is when the request's keys are remembered. The loads are Serve's own per-replica counts of requests routed
and not finished (its queue-length cache, probed where it has nothing recent).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from flashvlm.server.ray_serve.affinity import AffinityTable, RouteTicket, rank_replicas


class CacheAffinityRouter(RequestRouter):
    """Requests sharing an image or a prompt prefix go to the replica that served them, within a load bound; the
    rest to the least loaded (docs/distributed.md). kwargs (`request_router_kwargs`): max_keys, max_imbalance."""

    def initialize_state(self, max_keys: int = 65536, max_imbalance: int = 8, **_: Any) -> None:
        self._table = AffinityTable(max_keys)
        self._max_imbalance = max_imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # Without this Serve's retry loop would spin without pausing while every replica is full.
        pending_request.routing_context.should_backoff = True
        ticket = _ticket(pending_request)
        if ticket is None:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ticket.known_replicas = sorted(by_id)
        loads = await self._loads(candidate_replicas) if ticket.pin is None else dict.fromkeys(by_id)
        ranks = rank_replicas(ticket, loads, self._table, self._max_imbalance)
        return [[by_id[r] for r in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        ticket = _ticket(pending_request)
        if ticket is None:
            return
        ticket.replica = replica_id.unique_id
        if ticket.pin is None:
            self._table.remember(ticket.keys, replica_id.unique_id)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[str, int | None]:
        loads: dict[str, int | None] = {}
        stale: list[RunningReplica] = []
        for r in replicas:
            n = self.replica_queue_len_cache.get(r.replica_id)
            loads[r.replica_id.unique_id] = n
            if n is None:
                stale.append(r)
        if stale:
            # The probe Serve's own routers use (and its PrefixCacheAffinityRouter); it refreshes the cache too.
            for r, n in await self._probe_queue_lens(stale, 0):
                loads[r.replica_id.unique_id] = n
        return loads


def _ticket(pending_request: PendingRequest) -> RouteTicket | None:
    for arg in pending_request.args:
        if isinstance(arg, RouteTicket):
            return arg
    return None
