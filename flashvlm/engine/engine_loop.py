"""The background thread behind `AsyncEngine`: it owns the `Engine` and steps it; nothing else touches it.

The event loop hands it add / abort commands, drained between steps; outputs go back through
`loop.call_soon_threadsafe`. The thread sleeps on a condition variable while there is nothing to do. It uses
only `Engine`'s public methods.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flashvlm.engine.async_stream import ACCEPTED, AdmissionGate, EngineDeadError, EngineStepError, OutputSlot
from flashvlm.engine.engine import Engine
from flashvlm.processing.input_processor import ProcessedPrompt
from flashvlm.request import InvalidRequestError, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

# Consecutive failed steps after which every request is failed, not only the running ones: the fault
# is then not tied to the batch, and retrying the same schedule forever would spin.
_MAX_CONSECUTIVE_STEP_FAILURES = 3


@dataclass
class AddCommand:
    stream: OutputSlot
    processed: ProcessedPrompt
    params: SamplingParams
    priority: int
    arrival_time: float | None
    tier: str | None = None


@dataclass
class AbortCommand:
    request_id: str


Command = AddCommand | AbortCommand


class EngineLoop:
    """Steps one `Engine` on a daemon thread. `admission` (optional) hears the scheduler's waiting counts and the
    finished requests; `on_step(step_latency_s)` (optional) runs on this thread after every successful step, the
    one place other code may change the engine while the thread runs (e.g. its token budget)."""

    def __init__(self, engine: Engine, admission: AdmissionGate | None = None,
                 on_step: Callable[[float], None] | None = None) -> None:
        self.engine = engine
        self._admission = admission
        self._on_step = on_step
        self._wake = threading.Condition()
        self._commands: list[Command] = []
        self._stopping = False
        self.dead: BaseException | None = None
        """Why the thread stopped (shutdown or a fatal error); None while it serves."""
        # State only this thread touches.
        self._live: dict[str, OutputSlot] = {}
        self._consecutive_failures = 0
        self._num_steps = 0
        self._num_step_failures = 0
        self._num_aborted = 0
        self._stats: dict[str, Any] = {}
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="flashvlm-engine", daemon=True)
        self._thread.start()

    # ---- called from other threads ------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        return self.dead is None and not self._stopping

    def stats(self) -> dict[str, Any]:
        """The engine's numbers as of the last step (one snapshot, swapped whole)."""
        return self._stats

    def submit(self, command: Command) -> bool:
        """Queue a command for the next drain; False (nothing queued) once the thread has stopped."""
        with self._wake:
            if self.dead is not None:
                return False
            self._commands.append(command)
            self._wake.notify()
        return True

    def stop(self, timeout_s: float) -> None:
        """Stop after the current step and fail whatever is still in flight."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    # ---- the thread ---------------------------------------------------------------------------
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

    def _apply(self, commands: list[Command]) -> None:
        deliveries: list[tuple[OutputSlot, Any]] = []
        applied: list[int] = []
        for cmd in commands:
            if isinstance(cmd, AbortCommand):
                stream = self._live.pop(cmd.request_id, None)
                out = self._abort_in_engine(cmd.request_id)
                if out is not None and stream is not None:
                    deliveries.append((stream, out))
                continue
            deliveries.append((cmd.stream, self._add(cmd)))
            applied.append(cmd.priority)
        self._report_waiting(applied)
        self._deliver(deliveries)

    def _add(self, cmd: AddCommand) -> Any:
        """Add one request to the engine; ACCEPTED or the error its stream gets."""
        rid = cmd.stream.request_id
        try:
            if rid in self._live:
                raise InvalidRequestError(f"request_id {rid!r} is already in use")
            self.engine.add_processed(cmd.processed, cmd.params, request_id=rid, priority=cmd.priority,
                                      arrival_time=cmd.arrival_time, group=cmd.tier)
        except InvalidRequestError as e:
            return e
        except Exception as e:
            logger.exception("adding request %s failed", rid)
            return EngineStepError(f"the engine could not add the request: {e!r}")
        self._live[rid] = cmd.stream
        return ACCEPTED

    def _report_waiting(self, applied: list[int] | None = None) -> None:
        """Hand the scheduler's waiting counts by priority (and the adds just applied) to the admission bound."""
        if self._admission is not None:
            self._admission.update_engine(self.engine.waiting_by_priority(), applied or [])

    def _abort_in_engine(self, request_id: str) -> RequestOutput | None:
        out = self.engine.abort_request(request_id)
        if out is not None:
            self._num_aborted += 1
        return out

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._num_step_failures += 1
            self._consecutive_failures += 1
            logger.exception("engine step failed; failing the requests in the batch")
            self._fail_batch(e)
            return
        latency = time.perf_counter() - t0
        self._num_steps += 1
        self._consecutive_failures = 0
        deliveries = []
        finished = 0
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:
                continue
            deliveries.append((stream, out))
            if out.finished:
                finished += 1
                del self._live[out.request_id]
        self._report_waiting()
        if finished and self._admission is not None:
            self._admission.record_finished(finished)
        self._deliver(deliveries)
        if self._on_step is not None:
            try:
                self._on_step(latency)
            except Exception:  # a hook's bug must not take the engine down
                logger.exception("the after-step hook failed; it is switched off")
                self._on_step = None

    def _fail_batch(self, error: Exception) -> None:
        failed = list(dict.fromkeys(self.engine.running_request_ids() + self.engine.unscheduled_request_ids()))
        if not failed or self._consecutive_failures >= _MAX_CONSECUTIVE_STEP_FAILURES:
            failed = self.engine.unfinished_request_ids()
        err = EngineStepError(f"the engine failed while running this request: {type(error).__name__}: {error}")
        deliveries = []
        for rid in failed:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("aborting %s after a failed step failed too", rid)
            stream = self._live.pop(rid, None)
            if stream is not None:
                deliveries.append((stream, err))
        self._report_waiting()
        self._deliver(deliveries)

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            self.dead = error
            commands, self._commands = self._commands, []
        deliveries: list[tuple[OutputSlot, Any]] = [(c.stream, error) for c in commands if isinstance(c, AddCommand)]
        deliveries += [(s, error) for s in self._live.values()]
        self._live.clear()
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
                        self._live.pop(stream.request_id, None)
                        self._abort_in_engine(stream.request_id)

    def _publish_stats(self) -> None:
        stats = self.engine.stats()
        stats.update(num_steps=self._num_steps, num_step_failures=self._num_step_failures,
                     num_aborted=self._num_aborted, max_num_batched_tokens=stats["token_budget"],
                     num_free_blocks=stats["kv_free_blocks"], num_usable_blocks=stats["kv_num_blocks"])
        self._stats = stats  # one reference swap: readers on other threads see a whole snapshot


def _push_all(items: list[tuple[OutputSlot, Any]], t: float) -> None:
    for stream, item in items:
        stream.push(item, t)
