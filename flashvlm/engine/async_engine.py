"""Asyncio front of the synchronous `Engine`, for the server.

One background thread owns the engine and steps it; nothing else touches it. The event loop talks to
that thread through a command list (add / abort) drained between steps, and gets outputs back through
`loop.call_soon_threadsafe`. The thread sleeps on a condition variable while there is nothing to do.
Image decoding, preprocessing and tokenization run in a small thread pool, never on the event loop.

Outputs are cumulative (`RequestOutput.text` / `token_ids` hold everything so far), so a request keeps
only its latest undelivered output: a slow consumer skips intermediate ones without losing anything,
and memory per request stays bounded whatever the client's reading speed.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from flashvlm.engine.async_stream import (
    ACCEPTED,
    Admission,
    AdmissionSlot,
    EngineDeadError,
    EngineStepError,
    OutputSlot,
    QueueFullError,
    RequestStream,
)
from flashvlm.engine.engine import Engine
from flashvlm.processing.input_processor import ProcessedPrompt
from flashvlm.request import InvalidRequestError, RequestOutput, RequestStatus, SamplingParams

__all__ = ["AsyncEngine", "AdmissionSlot", "EngineDeadError", "EngineStepError", "QueueFullError", "RequestStream"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Consecutive failed steps after which every request is failed, not only the running ones: the fault
# is then not tied to the batch, and retrying the same schedule forever would spin.
_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class _Add:
    stream: OutputSlot
    processed: ProcessedPrompt
    params: SamplingParams
    priority: int
    arrival_time: float | None
    tier: str | None = None


@dataclass
class _Abort:
    request_id: str


@dataclass
class _EngineSide:
    """State only the engine thread touches."""

    live: dict[str, OutputSlot] = field(default_factory=dict)
    consecutive_failures: int = 0
    e2e_ema_s: float = 0.0
    num_steps: int = 0
    num_step_failures: int = 0
    num_aborted: int = 0


class AsyncEngine:
    """Serve one `Engine` to asyncio code.

    `max_waiting_requests` bounds requests admitted but not yet running (preprocessing, queued
    for the engine thread, or in the scheduler's waiting queue); beyond it `add_request` /
    `generate` raise `QueueFullError`. `admission` (an object with `check(num_waiting, num_ahead)
    -> retry_after_s | None`, see async_stream.Admission) replaces the built-in policy; `budget_controller` (with
    `update(step_latency_s, num_decode_seqs, active_tiers) -> token budget`) adapts the step's
    token budget after every step, never above the configured `max_num_batched_tokens`.
    Given an `LLM`, it takes over the LLM's engine: do not call the LLM directly while this runs.
    """

    def __init__(self, engine: Engine | Any, *, max_waiting_requests: int = 256, admission: Any = None,
                 budget_controller: Any = None, num_processing_threads: int = 2) -> None:
        if not isinstance(engine, Engine):  # an LLM: take its engine
            engine = engine.engine
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.budget_controller = budget_controller
        self._max_budget = engine.config.scheduler.max_num_batched_tokens
        self._wake = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._admission = Admission(max_waiting_requests, admission, self._retry_after)
        self._stopping = False
        self._dead: BaseException | None = None
        self._side = _EngineSide()
        self._stats: dict[str, Any] = {}
        if budget_controller is not None:
            # The controller needs each step's decode count; a one-slot log keeps that at no memory cost.
            engine.step_log = collections.deque(maxlen=1)  # type: ignore[assignment]
        self._executor = ThreadPoolExecutor(max_workers=max(1, num_processing_threads),
                                            thread_name_prefix="flashvlm-preprocess")
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="flashvlm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> AsyncEngine:
        return cls(Engine(config), **kwargs)

    # ---- properties ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def peak_num_waiting(self) -> int:
        """Most requests ever counted against `max_waiting_requests` at once."""
        return self._admission.peak_queued

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def stats(self) -> dict[str, Any]:
        """The engine's latest numbers (as of the last step) plus the admission counters."""
        return {**self._stats, **self._admission.stats()}

    # ---- preprocessing (thread pool) ----------------------------------------------------------
    async def run_in_executor(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking host work (image decode, preprocessing, tokenization) off the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args, **kwargs))

    async def process_prompt(self, prompt: str | dict[str, Any]) -> ProcessedPrompt:
        return await self.run_in_executor(self.engine.process_prompt, prompt)

    async def process_chat(self, messages: list[dict], **kwargs: Any) -> ProcessedPrompt:
        return await self.run_in_executor(self.engine.process_chat, messages, **kwargs)

    # ---- admission ----------------------------------------------------------------------------
    def check_admission(self, priority: int = 0) -> None:
        """Raise QueueFullError if a request of this priority arriving now would be refused (reserves nothing)."""
        self._admission.check(priority)

    def _retry_after(self, queued: int) -> float:
        # Time for the queue ahead to drain: each batch slot finishes a request every ~E2E seconds.
        slots = self.engine.config.scheduler.max_num_seqs
        e2e = self._side.e2e_ema_s or 1.0
        return float(min(60, max(1, round(queued * e2e / slots))))

    def _count_engine_waiting(self, applied: list[int] | None = None) -> None:
        """Engine thread: hand the scheduler's waiting counts by priority to the admission bound."""
        counts: dict[int, int] = {}
        if self.engine.scheduler.num_waiting:
            for req in self.engine.scheduler.requests.values():
                if req.status is RequestStatus.WAITING or req.status is RequestStatus.PREEMPTED:
                    counts[req.priority] = counts.get(req.priority, 0) + 1
        self._admission.update_engine(counts, applied or [])

    # ---- requests -----------------------------------------------------------------------------
    def reserve(self, priority: int = 0) -> AdmissionSlot:
        """Take a place in the waiting bound now, before slow preprocessing, so that work in preprocessing counts
        against `max_waiting_requests` too. Pass it to `add_request`; `release()` it if the request is dropped."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        self._check_alive()
        return self._admission.reserve(priority)

    async def add_request(self, prompt: ProcessedPrompt | str | dict[str, Any],
                          sampling_params: SamplingParams | None = None, request_id: str | None = None,
                          priority: int = 0, tier: str | None = None, arrival_time: float | None = None,
                          slot: AdmissionSlot | None = None) -> RequestStream:
        """Admit, preprocess (if `prompt` is not already a ProcessedPrompt) and queue a request; returns once
        the engine accepted it. Raises QueueFullError, InvalidRequestError or EngineDeadError. With a `slot` from
        `reserve()`, its priority is the request's."""
        if slot is None:
            slot = self.reserve(priority)
        priority = slot.priority
        try:
            if not isinstance(prompt, ProcessedPrompt):
                prompt = await self.process_prompt(prompt)
            params = sampling_params or self.engine.default_sampling_params()
            params.validate()
            stream = OutputSlot(str(request_id) if request_id is not None else uuid.uuid4().hex,
                             asyncio.get_running_loop(), tier)
            self._check_alive()
            self._admission.submit(slot)
            with self._wake:
                self._commands.append(_Add(stream, prompt, params, priority, arrival_time, tier))
                self._wake.notify()
        finally:
            slot.release()
        handle = RequestStream(stream, self._abort_nowait)
        try:
            while not stream.accepted:
                if stream.error is not None:
                    stream.done = True
                    raise stream.error
                stream.event.clear()
                await stream.event.wait()
        except asyncio.CancelledError:
            handle.close()  # the add may still be applied; the abort queued behind it undoes it
            raise
        return handle

    async def generate(self, prompt: ProcessedPrompt | str | dict[str, Any],
                       sampling_params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, tier: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield each new (cumulative) output of the request until it finishes. Stopping early (break,
        `aclose()`, cancellation) aborts it in the engine."""
        stream = await self.add_request(prompt, sampling_params, request_id, priority, tier)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        self._submit(_Abort(str(request_id)))

    def _abort_nowait(self, request_id: str) -> None:
        self._submit(_Abort(request_id))

    def _submit(self, command: _Add | _Abort) -> None:
        with self._wake:
            if self._dead is None:
                self._commands.append(command)
                self._wake.notify()

    def _check_alive(self) -> None:
        if self._dead is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running ({self._dead or 'shut down'})")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread (after its current step) and fail whatever is still in flight."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                with self._wake:
                    while not self._commands and not busy and not self._stopping:
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish_stats()
            self._fail_all(EngineDeadError("the engine was shut down"))
        except BaseException as e:  # a bug outside a step: say so loudly, then refuse further work
            logger.exception("engine thread died")
            self._fail_all(EngineDeadError(f"the engine thread died: {e!r}"))

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        deliveries: list[tuple[OutputSlot, Any]] = []
        applied: list[int] = []
        live = self._side.live
        for cmd in commands:
            if isinstance(cmd, _Abort):
                stream = live.pop(cmd.request_id, None)
                out = self._abort_in_engine(cmd.request_id)
                if out is not None and stream is not None:
                    deliveries.append((stream, out))
                continue
            rid = cmd.stream.request_id
            try:
                if rid in live:
                    raise InvalidRequestError(f"request_id {rid!r} is already in use")
                self.engine.add_processed(cmd.processed, cmd.params, request_id=rid, priority=cmd.priority,
                                          arrival_time=cmd.arrival_time, group=cmd.tier)
            except InvalidRequestError as e:
                deliveries.append((cmd.stream, e))
            except Exception as e:
                logger.exception("adding request %s failed", rid)
                deliveries.append((cmd.stream, EngineStepError(f"the engine could not add the request: {e!r}")))
            else:
                live[rid] = cmd.stream
                deliveries.append((cmd.stream, ACCEPTED))
            applied.append(cmd.priority)
        self._count_engine_waiting(applied)
        self._deliver(deliveries)

    def _abort_in_engine(self, request_id: str) -> RequestOutput | None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._side.num_aborted += 1
        return out

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._side.num_step_failures += 1
            self._side.consecutive_failures += 1
            logger.exception("engine step failed; failing the requests in the batch")
            self._fail_batch(e)
            return
        latency = time.perf_counter() - t0
        self._side.num_steps += 1
        self._side.consecutive_failures = 0
        live = self._side.live
        deliveries = []
        finished = 0
        for out in outputs:
            stream = live.get(out.request_id)
            if stream is None:
                continue
            deliveries.append((stream, out))
            if out.finished:
                finished += 1
                del live[out.request_id]
                if out.finish_time is not None:
                    e2e = out.finish_time - out.arrival_time
                    ema = self._side.e2e_ema_s
                    self._side.e2e_ema_s = e2e if ema == 0.0 else 0.9 * ema + 0.1 * e2e
        self._count_engine_waiting()
        self._admission.record_finished(finished)
        self._deliver(deliveries)
        if self.budget_controller is not None:
            try:
                self._adapt_budget(latency)
            except Exception:  # a controller bug must not take the engine down: serve on at the fixed budget
                logger.exception("the token budget controller failed; it is switched off")
                self.budget_controller = None
                self.engine.config.scheduler.max_num_batched_tokens = self._max_budget

    def _adapt_budget(self, latency: float) -> None:
        log = self.engine.step_log
        num_decode = log[-1].num_decode_tokens if log else 0
        requests = self.engine.scheduler.requests
        tiers = set()
        for rid, stream in self._side.live.items():
            req = requests.get(rid)
            if stream.tier is not None and req is not None and req.status is RequestStatus.RUNNING:
                tiers.add(stream.tier)
        budget = int(self.budget_controller.update(latency, num_decode, tiers))
        sched = self.engine.config.scheduler
        # Never above the configured budget: activation memory (and CUDA graphs) were sized for it.
        sched.max_num_batched_tokens = max(min(sched.max_num_seqs, self._max_budget), min(budget, self._max_budget))

    def _fail_batch(self, error: Exception) -> None:
        requests = self.engine.scheduler.requests
        running = [rid for rid, r in requests.items() if r.status is RequestStatus.RUNNING]
        if not running or self._side.consecutive_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
            running = list(requests)
        err = EngineStepError(f"the engine failed while running this request: {type(error).__name__}: {error}")
        deliveries = []
        for rid in running:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("aborting %s after a failed step failed too", rid)
            stream = self._side.live.pop(rid, None)
            if stream is not None:
                deliveries.append((stream, err))
        self._count_engine_waiting()
        self._deliver(deliveries)

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            self._dead = error
            commands, self._commands = self._commands, []
        deliveries: list[tuple[OutputSlot, Any]] = [(c.stream, error) for c in commands if isinstance(c, _Add)]
        deliveries += [(s, error) for s in self._side.live.values()]
        self._side.live.clear()
        self._deliver(deliveries)

    def _deliver(self, deliveries: list[tuple[OutputSlot, Any]]) -> None:
        if not deliveries:
            return
        now = time.time()
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputSlot, Any]]] = {}
        for stream, item in deliveries:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_push_all, items, now)
            except RuntimeError:  # that loop is closed: nobody will read these; free their engine state
                for stream, item in items:
                    if isinstance(item, RequestOutput) and not item.finished:
                        self._side.live.pop(stream.request_id, None)
                        self._abort_in_engine(stream.request_id)

    def _publish_stats(self) -> None:
        engine = self.engine
        sched = engine.scheduler
        stats: dict[str, Any] = {"num_running": sched.num_running, "num_waiting": sched.num_waiting,
                                 "kv_cache_usage": sched.block_manager.usage}
        engine_stats = getattr(engine, "stats", None)
        if callable(engine_stats):
            stats.update(engine_stats())
        stats.update(num_preemptions=sched.num_preemptions_total, num_steps=self._side.num_steps,
                     num_step_failures=self._side.num_step_failures, num_aborted=self._side.num_aborted,
                     max_num_batched_tokens=engine.config.scheduler.max_num_batched_tokens,
                     num_free_blocks=sched.block_manager.num_free_blocks,
                     num_usable_blocks=sched.block_manager.num_usable_blocks)
        self._stats = stats  # one reference swap: readers on other threads see a whole snapshot


def _push_all(items: list[tuple[OutputSlot, Any]], t: float) -> None:
    for stream, item in items:
        stream.push(item, t)
