"""Continuous-batching scheduler: CPU-only bookkeeping, no torch.

One rule covers chunked prefill and decode: every request tracks `num_computed_tokens`, and
each step hands out a token budget, first to running requests, then to waiting ones, each
getting `min(tokens not yet computed, budget left)`. A chunk that reaches the end of the
request's known tokens samples one token. Prefix-cache hits fit the same rule: at admission (of a
new request, or a preempted one resuming) the request shares the longest chain of cached KV blocks
matching its known tokens and starts with num_computed_tokens at the hit length; cached tokens
cost no budget. Images whose placeholders lie entirely inside the hit are never encoded.

Order is (priority, arrival, admission order): lower priority value first. When KV blocks run
out, the lowest-priority, latest-arrived running request is preempted by recompute: its blocks
are freed, num_computed_tokens goes back to 0 (its output tokens are kept) and it waits again.
"""

from __future__ import annotations

import bisect
import itertools
import time
from dataclasses import dataclass, field

from flashvlm.cache.block_manager import BlockManager, KVBlock
from flashvlm.cache.encoder_cache import EncoderCacheManager
from flashvlm.config import SchedulerConfig
from flashvlm.engine.sched_output import ScheduledRequest, SchedulerOutput
from flashvlm.request import Request, RequestStatus

KV_CAPACITY_STOP_REASON = "kv_cache_capacity"
"""stop_reason of a request aborted because its tokens exceed the whole KV cache."""

_OrderKey = tuple[int, float, int]


@dataclass
class _StepState:
    budget: int
    num_new: dict[str, int] = field(default_factory=dict)
    """request_id -> tokens this step; insertion order is batch order."""
    preempted: set[str] = field(default_factory=set)
    running_in: dict[str | None, int] = field(default_factory=dict)
    """Running requests per group, counted once admission starts (preemptions keep it current)."""
    capped: set[str] = field(default_factory=set)
    """Waiting requests passed over only because their group is at its hard cap."""


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager,
                 encoder_cache: EncoderCacheManager, *, max_model_len: int, lookahead_slots: int) -> None:
        self.config = scheduler_config
        self.max_model_len = max_model_len  # EngineLimits.max_model_len; 0: no limit (unit tests)
        self.lookahead_slots = lookahead_slots  # EngineLimits.lookahead_slots says what it buys
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id (waiting, preempted or running)."""
        # Both queues stay sorted by _key, so the head of _waiting is next to admit and the tail
        # of _running is the first preemption victim.
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._order: dict[str, _OrderKey] = {}
        self._counter = itertools.count()
        self._left_since_last_step: list[str] = []
        # Requests the scheduler itself finished (KV capacity); update() reports them.
        self._finished_unreported: list[Request] = []
        self.num_preemptions_total = 0
        self.num_images_skipped = 0
        """Images whose placeholders a prefix-cache hit covered entirely: no encoder run, no prefill."""

    # ---- queue state -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def _key(self, req: Request) -> _OrderKey:
        return self._order[req.request_id]

    def _remove(self, queue: list[Request], req: Request) -> None:
        # Keys are unique, so bisect finds the exact slot; avoids dataclass __eq__ on whole requests.
        i = bisect.bisect_left(queue, self._key(req), key=self._key)
        assert i < len(queue) and queue[i] is req, f"{req.request_id} is not in the expected queue"
        del queue[i]

    # ---- capacity ----------------------------------------------------------------------

    def max_kv_tokens(self, req: Request) -> int:
        """Most tokens of KV the request can ever hold: the last sampled token is never computed."""
        final = req.num_prompt_tokens + req.sampling_params.max_tokens
        if self.max_model_len > 0:
            final = min(final, max(self.max_model_len, req.num_prompt_tokens + 1))
        return final - 1

    def can_ever_fit(self, req: Request) -> bool:
        """False if the request would outgrow the whole KV cache; the engine rejects it at add time."""
        bm = self.block_manager
        return bm.blocks_for_tokens(self.max_kv_tokens(req)) <= bm.num_usable_blocks

    def _never_fits_now(self, req: Request) -> bool:
        # The next step needs KV for all tokens up to num_tokens; more than the cache: hopeless.
        bm = self.block_manager
        return bm.blocks_for_tokens(req.num_tokens) > bm.num_usable_blocks

    # ---- request lifecycle -------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._order[req.request_id] = (req.priority, req.arrival_time, next(self._counter))
        bisect.insort(self._waiting, req, key=self._key)

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> Request | None:
        """Finish a request from outside (abort, stop string). None if unknown or already finished."""
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        req = self.requests.get(request_id)
        if req is None:
            return None
        if stop_reason is not None:
            req.stop_reason = stop_reason
        self._finish(req, status)
        return req

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self._remove(self._running if req.status is RequestStatus.RUNNING else self._waiting, req)
        self.block_manager.forget(req.request_id)
        self.encoder_cache.release_all(req.request_id)
        req.status = status
        req.finish_time = time.time()
        del self.requests[req.request_id]
        del self._order[req.request_id]
        self._left_since_last_step.append(req.request_id)

    def _abort_for_capacity(self, req: Request) -> None:
        req.stop_reason = KV_CAPACITY_STOP_REASON
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._finished_unreported.append(req)

    def _preempt(self, req: Request, step: _StepState) -> None:
        self._remove(self._running, req)
        self.block_manager.free(req.request_id)
        self.encoder_cache.release_all(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        # Original key: it goes back ahead of every later arrival of its priority.
        bisect.insort(self._waiting, req, key=self._key)
        # If it was already given tokens this step (waiting-phase victim), hand them back.
        step.budget += step.num_new.pop(req.request_id, 0)
        step.preempted.add(req.request_id)
        if step.running_in.get(req.group):
            step.running_in[req.group] -= 1
        self._left_since_last_step.append(req.request_id)

    # ---- scheduling --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepState(budget=self.config.max_num_batched_tokens)
        deferred: list[Request] = []
        self._schedule_running(step, deferred)
        # After a preemption the cache is full: admitting new work would only thrash.
        if not step.preempted:
            self._schedule_waiting(step, may_wait=not deferred)
        for req in deferred:  # lower-priority prefill chunks take what admission left
            if step.budget <= 0:
                break
            if (req.status is RequestStatus.RUNNING and req.request_id not in step.num_new
                    and not self._schedule_one_running(req, step)):
                break

        bm = self.block_manager
        scheduled = []
        for rid, n in step.num_new.items():
            req = self.requests[rid]
            start = req.num_computed_tokens
            scheduled.append(ScheduledRequest(req, n, bm.get_block_ids(rid), start, start + n == req.num_tokens))
        # Encoder work is decided last, once preemptions are settled, so nothing has to be undone;
        # issue 5's encoder budget can clip chunks here.
        encoder_inputs = self._schedule_encoder_inputs(scheduled)
        output = SchedulerOutput(
            scheduled=scheduled,
            encoder_inputs=encoder_inputs,
            free_encoder_hashes=self.encoder_cache.pop_freeable(),
            finished_request_ids=self._left_since_last_step,
            # Requests held back by a hard cap stay held while nothing finishes: they do not count.
            may_admit=len(self._waiting) > len(step.capped) and len(self._running) < self.config.max_num_seqs,
        )
        self._left_since_last_step = []
        return output

    def _schedule_running(self, step: _StepState, deferred: list[Request]) -> None:
        """Tokens for running requests, in priority order. A request still prefilling whose priority is worse
        than the best waiting request's is deferred (appended to `deferred`) until after admission: a waiting
        gold request must not queue behind a running bronze prompt's next chunk. Decode tokens never wait."""
        best_waiting = self._waiting[0].priority if self._waiting else None
        i = 0
        while i < len(self._running) and step.budget > 0:
            req = self._running[i]
            if self._never_fits_now(req):
                self._abort_for_capacity(req)
                continue
            if (best_waiting is not None and req.priority > best_waiting
                    and req.num_tokens - req.num_computed_tokens > 1):
                deferred.append(req)
                i += 1
                continue
            if not self._schedule_one_running(req, step):
                break  # it preempted itself: it was the tail, so nothing is left behind it
            i += 1

    def _schedule_one_running(self, req: Request, step: _StepState) -> bool:
        """Allocate this step's tokens for a running request, preempting from the tail (the lowest priority,
        latest arrival) while blocks run out. False if that preempted the request itself."""
        num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
        target = req.num_computed_tokens + num_new
        ahead = self.lookahead_slots
        # Only from a comfortable surplus (a block for every running request left over), so a lookahead slot
        # never makes another request's real token preempt anyone.
        if (ahead and num_new == 1 and req.output_token_ids and target + ahead <= self.max_kv_tokens(req)
                and self.block_manager.num_free_blocks > len(self._running)):
            self.block_manager.allocate_slots(req.request_id, target + ahead)
        while not self.block_manager.allocate_slots(req.request_id, target):
            # The tail is never a request already given blocks ahead of this one in priority order.
            victim = self._running[-1]
            self._preempt(victim, step)
            if victim is req:
                return False
        step.num_new[req.request_id] = num_new
        step.budget -= num_new
        return True

    def _schedule_waiting(self, step: _StepState, may_wait: bool) -> None:
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

    def _admit(self, step: _StepState, borrow: bool, may_wait: bool) -> bool:
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
            prefix = bm.find_cached_prefix(req)
            if may_wait and self._waits_for_in_flight(req, len(prefix)):
                i += 1  # its shared blocks are being computed: cached hits in a step or two
                continue
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

    def _reclaim_slot(self, req: Request, target: int, prefix: list[KVBlock], step: _StepState) -> bool:
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
        (a shared system prompt) would cost a step of latency to save little."""
        wait = self.config.shared_prefix_wait_tokens
        bm = self.block_manager
        return wait > 0 and bm.num_in_flight_blocks(req, num_cached_blocks) * bm.block_size >= wait

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

    def _make_room(self, req: Request, target: int, prefix: list[KVBlock], step: _StepState) -> bool:
        """Preempt strictly-lower-priority running requests for req's blocks, if that is enough."""
        bm = self.block_manager
        if not self._room_possible(req, target, prefix):
            return False  # would preempt for nothing
        while not bm.allocate_slots(req.request_id, target, prefix):
            if not self._running or self._running[-1].priority <= req.priority:
                return False  # estimate was off (a block shared among victims); stay safe
            self._preempt(self._running[-1], step)
        return True

    def _schedule_encoder_inputs(self, scheduled: list[ScheduledRequest]) -> dict[str, list[int]]:
        enc = self.encoder_cache
        inputs: dict[str, list[int]] = {}
        for sr in scheduled:
            req = sr.request
            start, end = sr.start, sr.end
            for idx, item in enumerate(req.mm_items):
                if item.num_tokens <= 0 or item.offset >= end or item.end <= start:
                    continue
                # A hash already registered (by another request, an earlier chunk or an earlier
                # item of this batch) is computed once; add() then only takes a reference.
                if enc.needs_encode(item.mm_hash):
                    inputs.setdefault(req.request_id, []).append(idx)
                enc.add(req.request_id, item.mm_hash, item.num_tokens)
        return inputs

    # ---- results -----------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Apply a step's results. Returns requests that got a token or finished (engine emits them)."""
        live = [sr for sr in output.scheduled if sr.request.status is RequestStatus.RUNNING]
        for sr in live:
            if sr.samples and sr.request.request_id not in sampled:
                raise ValueError(f"no sampled token for request {sr.request.request_id!r}, "
                                 "whose chunk reached the end of its tokens")
        changed, self._finished_unreported = self._finished_unreported, []
        for sr in live:
            req = sr.request
            samples = sr.samples  # read before num_computed_tokens moves
            req.num_computed_tokens += sr.num_new_tokens
            self.block_manager.cache_computed_blocks(req)
            if req.mm_items:
                self._release_passed_items(req)
            # A token for a partial prefill chunk is meaningless; it is ignored.
            if not samples:
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = time.time()
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
            changed.append(req)
        return changed

    def _release_passed_items(self, req: Request) -> None:
        done = req.num_computed_tokens
        for mm_hash in self.encoder_cache.hashes_of(req.request_id):
            # The same image may appear twice in one prompt: keep it until the last use is passed.
            if all(it.end <= done for it in req.mm_items if it.mm_hash == mm_hash):
                self.encoder_cache.release(req.request_id, mm_hash)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        num_out = len(req.output_token_ids)
        # min_tokens counts tokens before the stop token, as transformers' min_new_tokens does.
        if num_out > sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if 0 < self.max_model_len <= req.num_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
