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

from flashvlm.cache.block_manager import BlockManager
from flashvlm.cache.encoder_cache import EncoderCacheManager
from flashvlm.config import SchedulerConfig
from flashvlm.engine.sched_output import ScheduledRequest, SchedulerOutput
from flashvlm.engine.sched_waiting import OrderKey, StepState, WaitingAdmission
from flashvlm.request import Request, RequestStatus

KV_CAPACITY_STOP_REASON = "kv_cache_capacity"
"""stop_reason of a request aborted because its tokens exceed the whole KV cache."""


class Scheduler(WaitingAdmission):
    """Owns every unfinished request's state (status, computed tokens, block table through the block manager,
    encoder-cache references) and the per-step token budget; nothing else writes them. Admission of waiting
    requests is in engine/sched_waiting.py."""

    def __init__(self, scheduler_config: SchedulerConfig, block_manager: BlockManager,
                 encoder_cache: EncoderCacheManager, *, max_model_len: int, lookahead_slots: int) -> None:
        self.config = scheduler_config
        self._max_model_len = max_model_len
        self._lookahead_slots = lookahead_slots
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id (waiting, preempted or running)."""
        # Both queues stay sorted by _key, so the head of _waiting is next to admit and the tail
        # of _running is the first preemption victim.
        self._waiting: list[Request] = []
        self._running: list[Request] = []
        self._order: dict[str, OrderKey] = {}
        self._counter = itertools.count()
        self._left_since_last_step: list[str] = []
        # Requests the scheduler itself finished (KV capacity); update() reports them.
        self._finished_unreported: list[Request] = []
        self.num_preemptions_total = 0
        self.num_images_skipped = 0
        """Images whose placeholders a prefix-cache hit covered entirely: no encoder run, no prefill."""
        self._token_budget = scheduler_config.max_num_batched_tokens

    @property
    def max_model_len(self) -> int:
        """EngineLimits.max_model_len, as the engine passed it (read-only); 0: no limit (unit tests)."""
        return self._max_model_len

    @property
    def lookahead_slots(self) -> int:
        """EngineLimits.lookahead_slots (read-only), which says what it buys."""
        return self._lookahead_slots

    # ---- queue state -------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        """Requests with a sample in the running batch (the samples of an n-request count once)."""
        return len(self._running_parents())

    @property
    def num_waiting(self) -> int:
        """Requests none of whose samples runs."""
        return sum(self.waiting_by_priority().values())

    @property
    def waiting_prompt_tokens(self) -> int:
        """Prompt tokens the waiting requests have not computed (each sample of an n-request counts)."""
        return sum(len(req.prompt_token_ids) - req.num_computed_tokens for req in self._waiting)

    def _running_parents(self) -> set[str]:
        return {req.parent_id or req.request_id for req in self._running}

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def waiting_by_priority(self) -> dict[int, int]:
        """How many requests wait (new or preempted) at each priority: a request with n > 1 once, and only while
        none of its samples runs."""
        running = self._running_parents()
        seen: set[str] = set()
        counts: dict[int, int] = {}
        for req in self._waiting:
            parent = req.parent_id or req.request_id
            if parent not in running and parent not in seen:
                seen.add(parent)
                counts[req.priority] = counts.get(req.priority, 0) + 1
        return counts

    def running_request_ids(self) -> list[str]:
        return [req.request_id for req in self._running]

    def running_groups(self) -> set[str]:
        """The groups (SLA tiers) with a request in the running batch; requests without a group are left out."""
        return {req.group for req in self._running if req.group is not None}

    @property
    def token_budget(self) -> int:
        """Tokens one step may schedule; starts at the configured max_num_batched_tokens."""
        return self._token_budget

    def set_token_budget(self, num_tokens: int) -> int:
        """Change the per-step token budget from the next schedule() on; clamped to [1, max_num_batched_tokens]
        (activation memory and CUDA graphs were sized for the configured budget). Returns the budget set."""
        self._token_budget = max(1, min(int(num_tokens), self.config.max_num_batched_tokens))
        return self._token_budget

    def _key(self, req: Request) -> OrderKey:
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

    def report_stop_string(self, req: Request, stop: str) -> None:
        """A request this scheduler finished (max_tokens, eos) whose output also ends in a stop string, found by the
        same token or only by the detokenizer's final flush: the stop string wins, as in vLLM. The request has
        left the queues already, so only its reported outcome changes."""
        if not req.is_finished or req.status is RequestStatus.FINISHED_ABORTED:
            raise ValueError(f"request {req.request_id!r} is {req.status.value}: not finished by a stop condition")
        req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop

    def add_stage_times(self, req: Request, *, vision_s: float = 0.0, detokenize_s: float = 0.0) -> None:
        """Add to a request's measured stage times (Request.stage_times): vision-tower time of a step that encoded
        its images, detokenization time; the engine measures them."""
        req.vision_s += vision_s
        req.detokenize_s += detokenize_s

    def _abort_for_capacity(self, req: Request) -> None:
        req.stop_reason = KV_CAPACITY_STOP_REASON
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._finished_unreported.append(req)

    def _preempt(self, req: Request, step: StepState) -> None:
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
        step = StepState(budget=self._token_budget)
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
        now = time.time()
        for rid, n in step.num_new.items():
            req = self.requests[rid]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            start = req.num_computed_tokens
            scheduled.append(ScheduledRequest(req, n, bm.get_block_ids(rid), start, start + n == req.num_tokens))
        # Encoder work is decided last, once preemptions are settled, so nothing has to be undone.
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

    def _schedule_running(self, step: StepState, deferred: list[Request]) -> None:
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

    def _schedule_one_running(self, req: Request, step: StepState) -> bool:
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
                enc.add(req.request_id, item.mm_hash, item.encoder_tokens)  # the tower's full output, pruned or not
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
