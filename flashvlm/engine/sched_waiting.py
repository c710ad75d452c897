"""The scheduler's admission of waiting requests (new or preempted): priority order, per-group hard caps and
work-conserving shares, waiting for shared prefix blocks in flight, and preempting worse-priority running requests
to make room. A mixin of `Scheduler` (engine/scheduler.py), which owns the queues it reads and changes."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flashvlm.cache.block_manager import BlockManager, KVBlock
from flashvlm.config import SchedulerConfig
from flashvlm.request import Request, RequestStatus

OrderKey = tuple[int, float, int]
"""(priority, arrival time, admission order): both queues are sorted by it."""


@dataclass
class StepState:
    """What one schedule() call has handed out so far."""

    budget: int
    num_new: dict[str, int] = field(default_factory=dict)
    """request_id -> tokens this step; insertion order is batch order."""
    preempted: set[str] = field(default_factory=set)
    running_in: dict[str | None, int] = field(default_factory=dict)
    """Running requests per group, counted once admission starts (preemptions keep it current)."""
    capped: set[str] = field(default_factory=set)
    """Waiting requests passed over only because their group is at its hard cap."""


class WaitingAdmission:
    """Scheduler methods that move waiting requests into the running batch."""

    config: SchedulerConfig
    block_manager: BlockManager
    num_images_skipped: int
    _waiting: list[Request]
    _running: list[Request]
    requests: dict[str, Request]

    if TYPE_CHECKING:  # defined by Scheduler
        def _key(self, req: Request) -> OrderKey: ...
        def _never_fits_now(self, req: Request) -> bool: ...
        def _abort_for_capacity(self, req: Request) -> None: ...
        def _preempt(self, req: Request, step: StepState) -> None: ...

    def _schedule_waiting(self, step: StepState, may_wait: bool) -> None:
        """Admit waiting requests in priority order. A group at its share (`share_running_per_group`) is passed
        over in a first pass, so the slot goes to requests behind it, and admitted in a second pass if slots and
        budget are left: shares are work-conserving. A borrowed slot is taken back (its request preempted) when
        a better-priority request of a group within its share finds the batch full. Hard caps
        (`max_running_per_group`) are never exceeded. `may_wait`: whether a request may wait for shared blocks in
        flight; not while a prefilling request is deferred for a better waiting one, which may be the very
        request computing those blocks (the waiter would wait on work it holds back)."""
        if self.config.max_running_per_group or self.config.share_running_per_group:
            for r in self._running:
                step.running_in[r.group] = step.running_in.get(r.group, 0) + 1
        if self._admit(step, borrow=False, may_wait=may_wait) and self.config.share_running_per_group:
            self._admit(step, borrow=True, may_wait=may_wait)

    def _admit(self, step: StepState, borrow: bool, may_wait: bool) -> bool:
        """One admission pass; False if it stopped at a request that cannot start (so nothing behind it may)."""
        bm = self.block_manager
        running_in = step.running_in
        hard, share = self.config.max_running_per_group, self.config.share_running_per_group
        i = 0
        while i < len(self._waiting) and step.budget > 0:
            full = len(self._running) >= self.config.max_num_seqs
            if full and not share:
                return False  # only taking back a borrowed slot could seat anyone, and nothing is lent
            req = self._waiting[i]
            if self._never_fits_now(req):
                self._abort_for_capacity(req)
                continue
            if req.request_id in step.preempted:
                return False  # evicted this very step; strict FCFS keeps everyone behind it waiting too
            n = running_in.get(req.group, 0)
            over_share = req.group in share and n >= share[req.group]
            if req.group in hard and n >= hard[req.group]:
                step.capped.add(req.request_id)
                i += 1  # its group is full; that must not hold back other groups behind it
                continue
            if over_share and not borrow:
                i += 1
                continue
            # Waiting requests (new or preempted) hold no blocks and have num_computed_tokens == 0.
            prefix = bm.find_cached_prefix(req) if bm.enable_prefix_caching else self._sibling_prompt(req)
            if may_wait and (prefix is None or self._waits_for_in_flight(req, len(prefix))):
                i += 1  # its shared blocks are being computed: cached hits (or a sibling's blocks) in a step or two
                continue
            prefix = prefix or []
            num_hit = len(prefix) * bm.block_size
            num_new = min(req.num_tokens - num_hit, step.budget)
            target = num_hit + num_new
            # After the wait check, so a borrowed slot is never taken back for a request that then waits; and
            # only if the request's blocks can then be found, so it is never taken back for nothing.
            if full and (over_share or not self._reclaim_slot(req, target, prefix, step)):
                return False
            if (not bm.allocate_slots(req.request_id, target, prefix)
                    and not self._make_room(req, target, prefix, step)):
                return False  # no skipping ahead: later requests have equal or lower priority
            self._waiting.pop(i)  # victims preempted for req have worse priority: they queue behind it
            running_in[req.group] = running_in.get(req.group, 0) + 1
            bm.mark_in_flight(req, len(prefix))
            self._admitted(req, num_hit)
            req.status = RequestStatus.RUNNING
            bisect.insort(self._running, req, key=self._key)
            step.num_new[req.request_id] = num_new
            step.budget -= num_new
        return True

    def _reclaim_slot(self, req: Request, target: int, prefix: list[KVBlock], step: StepState) -> bool:
        """Preempt the newest running request of worse priority whose group is past its share, if there is one
        and req's blocks (up to `target`) can then be found."""
        share = self.config.share_running_per_group
        for victim in reversed(self._running):
            g = victim.group
            if victim.priority > req.priority and g in share and step.running_in.get(g, 0) > share[g]:
                if not self._room_possible(req, target, prefix):
                    return False
                self._preempt(victim, step)
                return True
        return False

    def _waits_for_in_flight(self, req: Request, num_cached_blocks: int) -> bool:
        """Worth waiting only for a long shared run (an image's placeholders, a long document): a short one
        (a shared system prompt) would cost a step of latency to save little. A sample of an n-request always
        waits: its prompt is the one a sibling computes, and computing it again is the very cost n > 1 avoids."""
        wait = self.config.shared_prefix_wait_tokens
        bm = self.block_manager
        in_flight = bm.num_in_flight_blocks(req, num_cached_blocks)
        if req.parent_id is not None:
            return in_flight > 0
        return wait > 0 and in_flight * bm.block_size >= wait

    def _sibling_prompt(self, req: Request) -> list[KVBlock] | None:
        """Without prefix caching, a sample of an n-request shares sample 0's full prompt blocks directly (their
        prompts are one list): the blocks it may share once sample 0 has computed them, None while sample 0 (running)
        still computes them, [] when there is nothing to share (no sibling running, or a prompt under a block)."""
        leader = self.requests.get(req.parent_id) if req.parent_id is not None else None  # sample 0 has that id
        if leader is None or leader is req or leader.status is not RequestStatus.RUNNING:
            return []
        bm = self.block_manager
        # As find_cached_prefix: at least one token is left to compute, in a block of its own.
        want = min(req.num_tokens - 1, req.num_prompt_tokens) // bm.block_size
        if min(leader.num_computed_tokens, leader.num_prompt_tokens) // bm.block_size < want:
            return None
        return bm.blocks_of(leader.request_id)[:want]

    def _admitted(self, req: Request, num_hit: int) -> None:
        req.num_computed_tokens = num_hit
        if self.block_manager.enable_prefix_caching:
            self.block_manager.prefix_stats.record(req.num_tokens, num_hit)
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit  # a resumed request's hits on its own old blocks do not count
        if num_hit:
            self.num_images_skipped += sum(1 for it in req.mm_items if it.num_tokens > 0 and it.end <= num_hit)

    def _room_possible(self, req: Request, target: int, prefix: list[KVBlock]) -> bool:
        """Whether req's blocks up to `target` fit once every strictly-lower-priority running request is
        preempted. A prefix block a victim frees comes back to the free list and is taken again at once, so it
        does not count."""
        bm = self.block_manager
        keep = set(prefix)
        reclaimable = sum(bm.num_blocks_freed_by(r.request_id, keep) for r in self._running
                          if r.priority > req.priority)
        return bm.num_free_blocks + reclaimable >= bm.num_new_blocks_needed(req.request_id, target, prefix)

    def _make_room(self, req: Request, target: int, prefix: list[KVBlock], step: StepState) -> bool:
        """Preempt strictly-lower-priority running requests for req's blocks, if that is enough."""
        bm = self.block_manager
        if not self._room_possible(req, target, prefix):
            return False  # would preempt for nothing
        while not bm.allocate_slots(req.request_id, target, prefix):
            if not self._running or self._running[-1].priority <= req.priority:
                return False  # estimate was off (a block shared among victims); stay safe
            self._preempt(self._running[-1], step)
        return True
