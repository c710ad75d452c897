"""Asyncio front of the synchronous `Engine`, for the server.

One background thread (engine/engine_loop.py) owns the engine and steps it; this class queues add / abort
commands for it and hands each request an async iterator over its outputs. Preprocessing runs off the event
loop in a PromptPipeline (flashvlm/processing/prompt_pipeline.py): text on a few threads, images on a pool of their
own shared fairly between requests.

Outputs are cumulative (`RequestOutput.text` / `token_ids` hold everything so far), so a request keeps
only its latest undelivered output: a slow consumer skips intermediate ones without losing anything,
and memory per request stays bounded whatever the client's reading speed.

Serving policy is not decided here: an admission bound (`admission`, e.g. flashvlm.server.admission.Admission)
and an after-step hook (`on_step`, e.g. flashvlm.server.budget.BudgetSteering.after_step) come from outside.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from flashvlm.engine.async_stream import (
    AdmissionGate,
    AdmissionTicket,
    EngineDeadError,
    EngineStepError,
    OutputSlot,
    RequestStream,
)
from flashvlm.engine.engine import Engine
from flashvlm.engine.engine_loop import AbortCommand, AddCommand, EngineLoop
from flashvlm.processing.input_processor import ProcessedPrompt
from flashvlm.processing.prompt_pipeline import NO_BUDGET, ImageBudget, ImageLoader, PromptPipeline
from flashvlm.request import InvalidRequestError, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStepError", "RequestStream"]

T = TypeVar("T")


class AsyncEngine:
    """Serve one `Engine` to asyncio code.

    `admission` (optional; see async_stream.AdmissionGate) bounds the requests admitted but not yet running:
    `reserve` / `add_request` / `generate` raise whatever it refuses with (the server's Admission raises
    QueueFullError), and the engine thread reports the scheduler's waiting counts and finished requests to it.
    Without one every request is admitted. `on_step(step_latency_s)` runs on the engine thread after every
    successful step: the one place other code may change the engine while it serves (the adaptive token budget).
    Given an `LLM`, it takes over the LLM's engine: do not call the LLM directly while this runs.
    """

    def __init__(self, engine: Engine | Any, *, admission: AdmissionGate | None = None,
                 on_step: Callable[[float], None] | None = None, num_processing_threads: int = 2,
                 image_threads: int | None = None, image_decodes_per_request: int | None = None) -> None:
        """num_processing_threads: text threads (templating, tokenizing); image_threads and
        image_decodes_per_request size the image pool (None: from the machine, see processing/image_pool.py)."""
        if not isinstance(engine, Engine):  # an LLM: take its engine
            engine = engine.engine
        self.engine = engine
        self.admission = admission
        # Structured-output constraints compile on their own threads (seconds for a large bounded repetition), so a
        # slow compile holds up only other constrained requests, never image preprocessing or plain prompts; two,
        # so one slow schema does not hold up every other one.
        self._grammar_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="flashvlm-grammar")
        self.pipeline = PromptPipeline(engine.input_processor, num_processing_threads, image_threads,
                                       image_decodes_per_request)
        self._loop = EngineLoop(engine, admission, on_step)

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> AsyncEngine:
        return cls(Engine(config), **kwargs)

    # ---- properties ---------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_alive(self) -> bool:
        return self._loop.is_alive

    def default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def stats(self) -> dict[str, Any]:
        """The engine's latest numbers (as of the last step), the admission counters and the image pool's jobs."""
        admission = self.admission.stats() if self.admission is not None else {}
        return {**self._loop.stats(), **admission, **self.pipeline.images.stats()}

    # ---- preprocessing (off the event loop) ---------------------------------------------------
    async def run_in_executor(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking host work that is not image work (file reads, templating) on the text threads."""
        return await self.pipeline.run_text(fn, *args, **kwargs)

    async def process_prompt(self, prompt: str | dict[str, Any], load: ImageLoader | None = None,
                             budget: ImageBudget = NO_BUDGET) -> ProcessedPrompt:
        return await self.pipeline.process(prompt, load=load, budget=budget)

    async def process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None = None,
                           chat_template: str | None = None, load: ImageLoader | None = None,
                           budget: ImageBudget = NO_BUDGET, tools: list[dict] | None = None) -> ProcessedPrompt:
        """`load`: turns each image source into what the processor decodes (the server's media policy);
        `budget`: what the request's images may cost (ImageBudgetError, a 400, past it); `tools`: the functions
        rendered into the prompt."""
        return await self.pipeline.process_chat(messages, mm_processor_kwargs, chat_template, load=load,
                                                budget=budget, tools=tools)

    # ---- requests -----------------------------------------------------------------------------
    def reserve(self, priority: int = 0) -> AdmissionTicket | None:
        """Take a place in the admission bound now, before slow preprocessing, so that work in preprocessing counts
        against it too (None without an admission bound). Pass it to `add_request`; `release()` it if the
        request is dropped."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        self._check_alive()
        return self.admission.reserve(priority) if self.admission is not None else None

    async def add_request(self, prompt: ProcessedPrompt | str | dict[str, Any],
                          sampling_params: SamplingParams | None = None, request_id: str | None = None,
                          priority: int = 0, tier: str | None = None, arrival_time: float | None = None,
                          slot: AdmissionTicket | None = None) -> RequestStream:
        """Admit, preprocess (if `prompt` is not already a ProcessedPrompt) and queue a request; returns once
        the engine accepted it. Raises the admission's refusal, InvalidRequestError or EngineDeadError. With a
        `slot` from `reserve()`, its priority is the request's."""
        if slot is None:
            slot = self.reserve(priority)
        if slot is not None:
            priority = slot.priority
        try:
            if not isinstance(prompt, ProcessedPrompt):
                prompt = await self.process_prompt(prompt)
            params = sampling_params or self.engine.default_sampling_params()
            params.validate()
            if params.structured_outputs is not None:  # compiled off the engine thread; the engine's is then cached
                await asyncio.get_running_loop().run_in_executor(self._grammar_executor, self.engine.structured.check,
                                                                 params.structured_outputs)
            stream = OutputSlot(str(request_id) if request_id is not None else uuid.uuid4().hex,
                                asyncio.get_running_loop())
            self._check_alive()
            if slot is not None:
                slot.submit()
            if not self._loop.submit(AddCommand(stream, prompt, params, priority, arrival_time, tier)):
                self._check_alive()
        finally:
            if slot is not None:
                slot.release()
        return await self._accepted(stream)

    async def _accepted(self, stream: OutputSlot) -> RequestStream:
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
        self._loop.submit(AbortCommand(str(request_id)))

    def _abort_nowait(self, request_id: str) -> None:
        self._loop.submit(AbortCommand(request_id))

    def _check_alive(self) -> None:
        if not self._loop.accepting:
            raise EngineDeadError(f"the engine is not running ({self._loop.dead or 'shut down'})")

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine thread (after its current step), fail whatever is still in flight, and stop the
        engine's tensor-parallel workers."""
        self._loop.stop(timeout_s)
        self.pipeline.shutdown()
        self._grammar_executor.shutdown(wait=False, cancel_futures=True)
        self.engine.close()
