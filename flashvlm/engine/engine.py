"""The synchronous engine: add requests, step (schedule -> execute -> update), emit outputs."""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import torch

from flashvlm.attention.kv_quant import dtype_name
from flashvlm.cache.block_manager import BlockManager
from flashvlm.cache.encoder_cache import EncoderCacheManager
from flashvlm.config import EngineConfig
from flashvlm.distributed.workers import TensorParallel
from flashvlm.engine.detokenizer import IncrementalDetokenizer
from flashvlm.engine.limits import EngineLimits
from flashvlm.engine.model_setup import setup_model
from flashvlm.engine.request_outputs import Sample, TrackedRequest, sample_params, sample_request_id
from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.engine.scheduler import Scheduler
from flashvlm.engine.stats import StepRecord, record_step
from flashvlm.processing.input_processor import InputProcessor, ProcessedPrompt
from flashvlm.pruning.setting import PruningChoice
from flashvlm.quant.apply import quantization_summary
from flashvlm.request import (
    InvalidRequestError,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from flashvlm.runner.memory_planner import PIXEL_CACHE_BYTES
from flashvlm.runner.model_runner import ModelRunner, StepTimings
from flashvlm.structured.manager import REJECTED_STOP_REASON, StructuredOutputs

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None) -> None:
        """`tp`: given to the engines of ranks 1..N-1 by their worker process; rank 0 (the caller) starts its
        own, spawning those workers (distributed/workers.py)."""
        self.config = config.validate()
        self.tp = tp if tp is not None else TensorParallel.start(config)
        self._forgotten: list[str] = []
        """Requests forgotten since the last step, for the workers' runners."""
        try:
            self._build(config)
        except BaseException as e:
            if self.tp.group.is_driver:
                self.tp.check(e)
            raise

    def _build(self, config: EngineConfig) -> None:
        mc = config.model
        torch.manual_seed(mc.seed)
        loaded = setup_model(config, self.tp)
        self.checkpoint, self.model, self.dtype = loaded.checkpoint, loaded.model, loaded.dtype
        self.load_time = loaded.load_time
        cache = config.cache
        text_cfg = self.checkpoint.text_config
        # "Caching off" (both caches off) also turns off the preprocessed-pixel cache: a cold baseline.
        caching = cache.enable_prefix_caching or cache.encoder_cache_tokens > 0
        on_gpu = torch.device(config.device).type == "cuda"
        self.input_processor = InputProcessor(self.checkpoint, text_cfg.vocab_size, self.model.image_token_id,
                                              pixel_cache_bytes=PIXEL_CACHE_BYTES if caching else 0,
                                              preprocess_device=config.device if config.preprocess_on_gpu else None,
                                              pruning=PruningChoice(mc.mm_token_pruning, mc.mm_token_keep_ratio,
                                                                    mc.mm_token_dedup_threshold),
                                              resize_on_device=on_gpu)
        self.eos_token_ids = self.checkpoint.eos_token_ids()
        self.structured = StructuredOutputs(self.checkpoint.tokenizer, text_cfg.vocab_size, self.eos_token_ids,
                                            pin_memory=on_gpu)
        """Constrained requests' grammar matchers (structured outputs): added here, advanced after each update."""
        self.runner = ModelRunner(config, self.model, self.dtype, max_model_len=loaded.max_len,
                                  attention_backend=loaded.attention_backend, structured=self.structured)
        kv_scale_source = self.runner.set_kv_scales(loaded.kv_scheme)
        num_blocks = self.tp.group.min_int(self.runner.determine_num_blocks(
            lambda: self.input_processor.profile_items(config.scheduler.max_num_batched_tokens)))
        self.runner.allocate_kv_cache(num_blocks)
        self.limits = EngineLimits(max_model_len=loaded.max_len, num_kv_blocks=num_blocks,
                                   lookahead_slots=1 if self.runner.pipeline is not None else 0,
                                   attention_backend=loaded.attention_backend, vision_attention=loaded.vision_attention,
                                   quantization=None if loaded.quant_plan is None else
                                   quantization_summary(self.model, loaded.quant_plan),
                                   kv_cache_dtype=dtype_name(self.runner.kv_dtype), kv_scale_source=kv_scale_source)
        """What this engine runs with, derived above; the config stays as validated."""
        self.scheduler = Scheduler(config.scheduler,
                                   BlockManager(num_blocks, cache.block_size, cache.enable_prefix_caching),
                                   EncoderCacheManager(cache.encoder_cache_tokens),
                                   max_model_len=loaded.max_len, lookahead_slots=self.limits.lookahead_slots)
        self.tokenizer = self.checkpoint.tokenizer
        self._tracked: dict[str, TrackedRequest] = {}
        """Unfinished requests by the caller's id."""
        self._samples: dict[str, tuple[TrackedRequest, Sample]] = {}
        """Their unfinished samples by scheduler id (sample_request_id)."""
        self.step_log: list[StepRecord] | None = None
        """Set to a list to record every step (benchmarks); None costs nothing."""
        self._ids = itertools.count()
        self._image_tokens = [0, 0]
        """Image tokens of the requests added: as the tower yields them, and kept (pruning), for stats()."""
        logger.info("engine ready: %s on %s (%s), %d KV blocks of %d tokens in %s, loaded in %.1fs",
                    self.checkpoint.path.name, config.device, self.dtype, num_blocks,
                    config.cache.block_size, self.limits.kv_cache_dtype, self.load_time)

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output of one request, in tokens (EngineLimits.max_model_len)."""
        return self.limits.max_model_len

    # ---- requests ------------------------------------------------------------------------------
    def default_sampling_params(self) -> SamplingParams:
        """The checkpoint's generation_config.json sampling defaults (as transformers applies them)."""
        gen = self.checkpoint.generation_defaults
        kwargs: dict[str, Any] = {k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                                     "repetition_penalty") if gen.get(k) is not None}
        if not gen.get("do_sample", False):  # transformers decodes greedily unless do_sample is set
            kwargs["temperature"] = 0.0
        if kwargs.get("top_k") == 0:
            kwargs["top_k"] = -1
        try:
            return SamplingParams(**kwargs)
        except InvalidRequestError:
            logger.warning("ignoring invalid sampling defaults in generation_config.json: %s", kwargs)
            return SamplingParams()

    def process_prompt(self, prompt: str | dict[str, Any]) -> ProcessedPrompt:
        return self.input_processor.process(prompt)

    def process_chat(self, messages: list[dict], **kwargs: Any) -> ProcessedPrompt:
        return self.input_processor.process_chat(messages, **kwargs)

    def add_processed(self, processed: ProcessedPrompt, sampling_params: SamplingParams | None = None,
                      request_id: str | None = None, priority: int = 0,
                      arrival_time: float | None = None, group: str | None = None) -> Request:
        """Queue a request; with SamplingParams.n > 1 as n samples (sample_request_id), of which the first, which
        carries `request_id`, is returned. Outputs and abort_request use `request_id` for all of them."""
        params = sampling_params or self.default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self.structured.check(params.structured_outputs)
        if not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        sample_ids = [sample_request_id(request_id, i) for i in range(params.n)]
        if request_id in self._tracked or any(sid in self._samples for sid in sample_ids):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        n, limit = len(processed.prompt_token_ids), self.max_model_len
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        if n >= limit:
            raise InvalidRequestError(f"prompt is {n} tokens long; max_model_len is {limit} "
                                      "(the prompt plus at least one generated token must fit)")
        arrival = arrival_time if arrival_time is not None else processed.arrival_time
        reqs = [Request(request_id=sid, prompt_token_ids=processed.prompt_token_ids,
                        sampling_params=sample_params(params, i), mm_items=processed.mm_items, priority=priority,
                        arrival_time=arrival, eos_token_ids=self.eos_token_ids, preprocess_s=processed.preprocess_s,
                        group=group, parent_id=request_id if params.n > 1 else None)
                for i, sid in enumerate(sample_ids)]
        if not self.scheduler.can_ever_fit(reqs[0]):
            raise InvalidRequestError(f"prompt of {n} tokens needs more KV cache than the engine has "
                                      f"({self.limits.num_kv_blocks - 1} blocks of {self.config.cache.block_size})")
        tracked = TrackedRequest(request_id, [
            Sample(i, req, IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                                                  params.stop), [] if params.logprobs is not None else None)
            for i, req in enumerate(reqs)])
        self._tracked[request_id] = tracked
        self._image_tokens[0] += sum(it.encoder_tokens for it in processed.mm_items)
        self._image_tokens[1] += sum(it.num_tokens for it in processed.mm_items)
        # In index order: the scheduler admits sample 0 first and holds its siblings until it computed the prompt.
        for sample in tracked.samples:
            self._samples[sample.request.request_id] = (tracked, sample)
            self.structured.add(sample.request)
            self.scheduler.add_request(sample.request)
        return reqs[0]

    def add_request(self, prompt: str | dict[str, Any], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> Request:
        return self.add_processed(self.process_prompt(prompt), sampling_params, request_id, priority)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a request (all its samples); its final output, or None if it is unknown or finished."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        for sample in tracked.unfinished():
            self.scheduler.abort_request(sample.request.request_id)
            self._finish_sample(sample)
        return self._finish_output(tracked)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def unfinished_request_ids(self) -> list[str]:
        """Every request added and not yet finished (waiting, preempted or running)."""
        return list(self._tracked)

    def unscheduled_request_ids(self) -> list[str]:
        """Unfinished requests none of whose open samples the scheduler still holds: a step that failed after the
        scheduler finished them and before their outputs were made leaves such requests behind."""
        return [rid for rid, tracked in self._tracked.items()
                if all(self.scheduler.get_request(s.request.request_id) is None for s in tracked.samples if not s.done)]

    def running_request_ids(self) -> list[str]:
        """Requests with a sample in the running batch."""
        ids = (self._samples[sid][0].request_id for sid in self.scheduler.running_request_ids())
        return list(dict.fromkeys(ids))

    def waiting_work(self) -> tuple[int, int]:
        """(requests added and not started, new or preempted; their prompt tokens not yet computed)."""
        return self.scheduler.num_waiting, self.scheduler.waiting_prompt_tokens

    def waiting_by_priority(self) -> dict[int, int]:
        """Requests waiting for the scheduler (new or preempted), counted by priority."""
        return self.scheduler.waiting_by_priority()

    def running_groups(self) -> set[str]:
        """The groups (the server's SLA tiers) with a request in the running batch."""
        return self.scheduler.running_groups()

    # ---- token budget --------------------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        """Tokens one step may schedule now (the configured max_num_batched_tokens unless set lower)."""
        return self.scheduler.token_budget

    def set_token_budget(self, num_tokens: int) -> int:
        """Set the per-step token budget from the next step on, clamped to [1, max_num_batched_tokens]: activation
        memory and CUDA graphs were sized for the configured budget. Returns the budget set."""
        return self.scheduler.set_token_budget(num_tokens)

    # ---- stepping ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns an output for every request that got tokens or finished."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t_scheduled = time.perf_counter() if self.step_log is not None else t0
        # An empty step still goes through update(): it reports requests the scheduler ended itself.
        try:
            self.tp.broadcast_step(out, self._forgotten)
            self._forgotten = []
            if out.is_empty:
                self.runner.release(out)
                sampled, timings, logprobs = {}, StepTimings(), {}
            else:
                sampled, timings = self.runner.execute(out), self.runner.last_timings
                logprobs = self.runner.sampled_logprobs
        except BaseException as e:
            self._forget_unmade_embeddings()
            self.tp.check(e)
            raise
        if timings.num_images:
            by_id = {s.request.request_id: s.request for s in out.scheduled}
            for rid in out.encoder_inputs:
                self.scheduler.add_stage_times(by_id[rid], vision_s=timings.vision_s)
        t_update = time.perf_counter() if self.step_log is not None else t0
        changed = self.scheduler.update(out, sampled)
        if len(self.structured):
            self._advance_grammars(changed)
        touched: dict[str, TrackedRequest] = {}
        for req in changed:
            entry = self._samples.get(req.request_id)
            if entry is None:
                continue
            tracked, sample = entry
            touched[tracked.request_id] = tracked
            new_tokens = len(req.output_token_ids) - len(sample.detokenizer.token_ids)
            if sample.logprobs is not None and new_tokens > 0:
                sample.logprobs.append(logprobs[req.request_id])  # a step gives a request one token
            if new_tokens > 0:
                t_detok = time.perf_counter()
                sample.detokenizer.append(req.output_token_ids[-new_tokens:])
                self.scheduler.add_stage_times(req, detokenize_s=time.perf_counter() - t_detok)
                stop = sample.detokenizer.stopped_by
                if stop is not None and not req.is_finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop)
            if req.is_finished:
                self._finish_sample(sample)
        outputs = [self._finish_output(t) if t.finished else t.output() for t in touched.values()]
        if self.step_log is not None and not out.is_empty:
            self.step_log.append(self._step_record(out, timings, t0, t_scheduled, t_update))
        return outputs

    def _advance_grammars(self, changed: list[Request]) -> None:
        """Accept the constrained requests' new tokens into their matchers; end a request whose grammar has ended
        (its stop token accepted: only reachable with ignore_eos or below min_tokens) or refused the token."""
        refused, ended = self.structured.advance([r for r in changed if not r.is_finished])
        for rid in refused:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED, stop_reason=REJECTED_STOP_REASON)
        for rid in ended:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)

    def run_worker_step(self, out: SchedulerOutput, forgotten: list[str]) -> None:
        """Ranks 1..N-1: rank 0's step on this rank's runner (its samples are rank 0's too, and are dropped)."""
        for request_id in forgotten:
            self.runner.forget_request(request_id)
        if out.is_empty:
            self.runner.release(out)
        else:
            self.runner.execute(out)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at size 1); the engine takes no steps after."""
        self.tp.close(graceful=True)

    def _step_record(self, out: SchedulerOutput, timings: StepTimings, t0: float, t_scheduled: float,
                     t_update: float) -> StepRecord:
        end = time.perf_counter()
        patches = sum(self.checkpoint.family.vision_patches(it) for it in timings.encoded_items)
        return record_step(out, timings, start=t0, end=end, schedule_s=t_scheduled - t0, update_s=end - t_update,
                           image_patches=patches)

    def _forget_unmade_embeddings(self) -> None:
        """After a failed step: the scheduler registered this step's images as held before the runner encoded
        them. Entries whose embedding the runner does not hold are dropped, so the next request with the same
        image encodes it instead of finding nothing to splice (the step's requests are aborted by the caller)."""
        enc = self.scheduler.encoder_cache
        for mm_hash in enc.held_hashes() - self.runner.encoder_outputs.keys():
            enc.discard(mm_hash)

    def stats(self) -> dict[str, Any]:
        """Engine-wide state and cumulative cache counters (the server exports them as Prometheus metrics).

        Gauges: num_running, num_waiting, token_budget, kv_cache_usage (0..1; free cached blocks count as
        free), kv_free_blocks, kv_cached_blocks (in the prefix-cache index), encoder_cache_entries and
        encoder_cache_tokens (embeddings held). Counters since start: num_preemptions, kv_evicted_blocks
        (cached blocks reused for other content), prefix_cache_queries / prefix_cache_hits (tokens, once
        per admission), encoder_cache_hits / _misses (per request and image), encoder_cache_evictions,
        images_skipped_by_prefix_cache (no encoder run, no prefill), images_encoded (vision tower runs),
        image_tokens (of the requests added, as the tower yields them) and image_tokens_kept (those the language
        model sees after visual-token pruning)."""
        sched = self.scheduler
        bm, enc, prefix = sched.block_manager, sched.encoder_cache, sched.block_manager.prefix_stats
        return {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_preemptions": sched.num_preemptions_total,
            "token_budget": self.scheduler.token_budget,
            "kv_cache_usage": bm.usage,
            "kv_num_blocks": bm.num_usable_blocks,
            "kv_free_blocks": bm.num_free_blocks,
            "kv_cached_blocks": bm.num_cached_blocks,
            "kv_evicted_blocks": bm.num_evicted_blocks,
            "prefix_caching": bm.enable_prefix_caching,
            "prefix_cache_queries": prefix.queries,
            "prefix_cache_hits": prefix.hits,
            "prefix_cache_hit_rate": prefix.hit_rate,
            "encoder_cache_hits": enc.num_hits,
            "encoder_cache_misses": enc.num_misses,
            "encoder_cache_hit_rate": enc.hit_rate,
            "encoder_cache_evictions": enc.num_evictions,
            "encoder_cache_entries": enc.num_entries,
            "encoder_cache_tokens": enc.num_cached_tokens,
            "encoder_cache_budget_tokens": enc.cache_tokens,
            "images_skipped_by_prefix_cache": sched.num_images_skipped,
            "images_encoded": self.runner.num_encoded_images,
            "image_tokens": self._image_tokens[0],
            "image_tokens_kept": self._image_tokens[1],
            "pixel_cache_hits": self.input_processor.pixel_cache.num_hits,
        }

    def _finish_sample(self, sample: Sample) -> None:
        """A sample the scheduler finished (or just aborted): flush its text, settle its stop reason, forget it."""
        t0 = time.perf_counter()
        sample.detokenizer.flush()
        req = sample.request
        stop = sample.detokenizer.stopped_by
        if stop is not None and req.status is not RequestStatus.FINISHED_ABORTED:
            # A stop string wins over max_tokens or eos hit by the same token (as in vLLM), or found only by the
            # flush (the last token ended mid-character).
            self.scheduler.report_stop_string(req, stop)
        self.scheduler.add_stage_times(req, detokenize_s=time.perf_counter() - t0)
        self._samples.pop(req.request_id, None)
        self.structured.drop(req.request_id)
        self.runner.forget_request(req.request_id)
        if self.tp.group.size > 1:
            self._forgotten.append(req.request_id)
        sample.done = True

    def _finish_output(self, tracked: TrackedRequest) -> RequestOutput:
        self._tracked.pop(tracked.request_id, None)
        return tracked.output(final=True)
