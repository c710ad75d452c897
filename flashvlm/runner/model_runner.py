"""Owns the device side: the model, the KV cache, image embeddings in flight, and one step's execution.

Three helpers do the work: the MemoryPlanner sizes the KV cache, the StepExecutor picks and runs the language
model's execution path (and owns its graphs), the Sampler turns logits into tokens. The runner itself tracks
per-request state (positions, generators), runs the vision tower and times the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from flashvlm.attention.base import get_backend
from flashvlm.attention.kv_quant import FP8_KV_DTYPE
from flashvlm.config import EngineConfig
from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.kernels.dispatch import use_triton
from flashvlm.models.interfaces import VLModel
from flashvlm.request import MMItem, Request, TokenLogprobs
from flashvlm.runner.executor import ExecutionPath, StepExecutor, StepPlan
from flashvlm.runner.inputs import PositionStore
from flashvlm.runner.kv_scales import CALIBRATION_TOKENS, calibration_amax, resolve_kv_scales
from flashvlm.runner.logprobs import PendingLogprobs, gather_logprobs, read_back
from flashvlm.runner.lookahead import ranks_agree_ahead
from flashvlm.runner.memory_planner import MemoryPlanner
from flashvlm.runner.pruned_tokens import KeptTokens
from flashvlm.runner.sampler import Sampler, SamplerInputs, make_generator
from flashvlm.runner.step_graphs import StepGraphs
from flashvlm.runner.timing import StepTimer, StepTimings
from flashvlm.runner.vision_graphs import VisionGraphs
from flashvlm.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner", "StepTimings"]


class _ExecutorAttribute:
    """A runner attribute that reads and writes the executor's attribute of the given name."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, runner: ModelRunner, owner: type | None = None) -> Any:
        return getattr(runner.executor, self.name)

    def __set__(self, runner: ModelRunner, value: Any) -> None:
        setattr(runner.executor, self.name, value)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: VLModel, dtype: torch.dtype, *, max_model_len: int,
                 attention_backend: str, structured: StructuredOutputs | None = None) -> None:
        self.config = config
        self.structured = structured
        """The engine's constrained requests' matchers (structured outputs); the runner only asks for bitmasks."""
        self.model = model
        self.dtype = dtype
        self.max_model_len = max_model_len
        """EngineLimits.max_model_len: the graphs' longest sequence and the decode split bound."""
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.backend = get_backend(attention_backend)  # EngineLimits.attention_backend
        self.use_cuda_graphs = (not config.enforce_eager and self.device.type == "cuda"
                                and self.backend.graph_capturable)
        if self.backend.graph_capturable:
            # Decode split counts follow the batch shape only, never the step's lengths: graphs need that, and
            # eager steps use the same splits so both paths reduce in the same order (identical bf16 results).
            self.backend.max_seq_len_bound = max_model_len
        self.executor = StepExecutor(model, self.backend, self.block_size, dtype, self.device)
        self.vision_graphs: VisionGraphs | None = None
        """Vision-tower graphs for recurring image shapes (CUDA, models whose tower is capturable)."""
        # Unseeded requests draw from the engine's own generator, never torch's global one, so other torch
        # code in the process cannot change an engine's samples, and engines do not share a stream.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.model.seed))
        self.planner = MemoryPlanner(config, model, dtype, self.backend, self.sampler, max_model_len,
                                     self.use_cuda_graphs)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_dtype = self.planner.kv_dtype
        """The KV cache's dtype: the model's (kv_cache_dtype auto) or float8_e4m3fn."""
        self.kv_scale_source = "none"
        """Where an FP8 cache's per-layer scales came from: "checkpoint" or "calibrated" (set_kv_scales)."""
        self.positions = PositionStore()
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        """Vision embeddings by mm_hash; the scheduler's EncoderCacheManager decides what stays."""
        self.kept_tokens = KeptTokens(self.model.language_model.embed_tokens.embedding_dim,
                                      proportional=config.model.mm_token_proportional_attention,
                                      use_kernels=config.kernel_backend == "triton")
        """Pruned images' kept indices (chosen from encoder_outputs) and the positions built from them."""
        self.num_encoded_images = 0
        """Images run through the vision tower since start (cache tests and stats)."""
        self.generators: dict[str, torch.Generator | None] = {}
        self.last_timings = StepTimings()
        self._vision_timer = StepTimer(self.device)
        # Two forward timers, alternating by step: a lookahead step stops its timer while the step it launched
        # is still running, so it reports the previous step's time, read from the other timer.
        self._forward_timers = (StepTimer(self.device), StepTimer(self.device))
        self._step_parity = 0
        self.record_logits = False
        """Test hook: keep the logits of every sampled row in `recorded_logits`, by request id."""
        self.recorded_logits: dict[str, list[torch.Tensor]] = {}
        self.sampled_logprobs: dict[str, TokenLogprobs] = {}
        """The last execute()'s log-probabilities, by request id, for the sampled rows that asked for them."""

    # The executor's graphs, as the engine and tests reach them.
    graphs = _ExecutorAttribute("decode_graphs")
    step_graphs = _ExecutorAttribute("step_graphs")
    pipeline = _ExecutorAttribute("pipeline")

    # ---- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        return self.planner.kv_bytes_per_block()

    def set_kv_scales(self, kv_scheme: dict | None) -> str:
        """An FP8 cache's per-layer K and V scales, before the memory profile runs through them: the checkpoint's
        (kv_scheme: its validated kv_cache_scheme, or None), else calibrated on a seeded random prompt
        (runner/kv_scales.py). Returns and records their source; "none" for a cache in the model's dtype."""
        if self.kv_dtype != FP8_KV_DTYPE:
            return self.kv_scale_source
        sched = self.config.scheduler
        num_tokens = min(CALIBRATION_TOKENS, sched.max_num_batched_tokens, self.max_model_len)
        self.kv_scale_source = resolve_kv_scales(self.model, kv_scheme, lambda: calibration_amax(
            self.model, self.backend, self.dtype, self.device, self.block_size, num_tokens, self.config.model.seed))
        return self.kv_scale_source

    def determine_num_blocks(self, vision_items: Callable[[], list[MMItem]] | None = None) -> int:
        """KV blocks that fit (MemoryPlanner.determine_num_blocks)."""
        return self.planner.determine_num_blocks(vision_items)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, then (CUDA graphs on) capture the language-model graphs over it and set up the
        vision graphs."""
        spec = self.model.kv_cache_spec()
        self.kv_caches = [torch.zeros(2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                                      dtype=self.kv_dtype, device=self.device) for _ in range(spec.num_layers)]
        self.executor.kv_caches = self.kv_caches
        if self.config.model.mm_token_proportional_attention:
            self.executor.slot_bias = torch.zeros(num_blocks * self.block_size, dtype=torch.float32,
                                                  device=self.device)
        if not self.use_cuda_graphs:
            return
        self.executor.capture_graphs(self.config, self.max_model_len)
        reserve = self.planner.decode_graph_reserve()
        if self.graphs.memory_bytes > reserve:
            # The KV cache is already sized: say so rather than fail later under load.
            logger.warning("the decode graphs took %.0f MiB, above the %.0f MiB kept for them; lower "
                           "gpu_memory_utilization if steps run out of memory", self.graphs.memory_bytes / 2**20,
                           reserve / 2**20)
        if self.config.vision_graphs > 0 and self.model.vision_graphable:
            self.vision_graphs = VisionGraphs(self.model.encode_images, self.device, self.dtype,
                                              max_graphs=self.config.vision_graphs)

    def build_step_graphs(self, max_tokens: int) -> StepGraphs:
        return self.executor.build_step_graphs(max_tokens, self.config.scheduler.max_num_seqs, self.max_model_len)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one scheduled step; returns the sampled token of each request that reached its end."""
        self.release(out)
        self.sampled_logprobs = {}
        self._track_requests(out)
        encoded: tuple[MMItem, ...] = ()
        if out.encoder_inputs:
            self._vision_timer.start()
            encoded = self._encode_images(out)
            self._vision_timer.stop()
        self.kept_tokens.place(out, self.model, self.positions, self.encoder_outputs)

        timer, previous_timer = self._forward_timers[self._step_parity], self._forward_timers[1 - self._step_parity]
        self._step_parity ^= 1
        t_plan = time.perf_counter()
        allow_lookahead = not self.record_logits and ranks_agree_ahead(out, self.config.tensor_parallel_size)
        plan = self.executor.plan(out, self.positions, allow_lookahead=allow_lookahead)
        prepare_s = time.perf_counter() - t_plan
        # Started after the host built the inputs, so an idle GPU waiting on that host work is not counted busy.
        timer.start()
        if plan.path is ExecutionPath.LOOKAHEAD:
            tokens = self.executor.lookahead(out, plan, lambda logits: self._greedy_tokens(out, plan, logits))
            timer.stop()  # brackets the lookahead launched here: on average one step's time
            forward_s = previous_timer.seconds() if previous_timer.finished() else self.last_timings.forward_s
            self.last_timings = StepTimings(forward_s=forward_s, num_images=len(encoded), prepare_s=prepare_s,
                                            encoded_items=encoded)
            return dict(zip(plan.batch.sample_request_ids, tokens))
        logits = self.executor.logits(out, plan, self.encoder_outputs, self.kept_tokens)
        sample_ids = plan.sample_request_ids
        sampled: dict[str, int] = {}
        if sample_ids:
            tokens, logprobs = self._sample(out, sample_ids, logits)
            timer.stop()
            token_list, self.sampled_logprobs = read_back(tokens, logprobs)  # the step's one host sync
            sampled = dict(zip(sample_ids, token_list))
        else:
            timer.stop()
            if self.device.type == "cuda":
                timer.end_event.synchronize()
        self.last_timings = StepTimings(vision_s=self._vision_timer.seconds() if encoded else 0.0,
                                        forward_s=timer.seconds(), num_images=len(encoded), prepare_s=prepare_s,
                                        encoded_items=encoded)
        return sampled

    def _track_requests(self, out: SchedulerOutput) -> None:
        """Prompt positions (computed once per request by the model) and the generator of a seeded request."""
        for s in out.scheduled:
            req = s.request
            if not self.positions.has(req.request_id):
                pos, delta = self.model.prompt_positions(req.prompt_token_ids, req.mm_items)
                self.positions.put(req.request_id, pos, delta)
            if req.request_id not in self.generators:
                self.generators[req.request_id] = make_generator(req.sampling_params.seed, self.device)

    def _sampler_inputs(self, out: SchedulerOutput, sample_ids: list[str]) -> SamplerInputs:
        """The sampler's rows for `sample_ids`, with the constrained ones' grammar masks as they stand now."""
        by_id = {s.request.request_id: s.request for s in out.scheduled}
        reqs = [by_id[r] for r in sample_ids]
        mask = self.structured.bitmask(reqs) if self.structured is not None and len(self.structured) else None
        return SamplerInputs.for_requests(reqs, self.generators, mask)

    def _sample(self, out: SchedulerOutput, sample_ids: list[str],
                logits: torch.Tensor) -> tuple[torch.Tensor, PendingLogprobs | None]:
        """The sampled tokens (on the device) and, for the rows that ask, their raw logits' log-probabilities."""
        if self.record_logits:
            for r, row in zip(sample_ids, logits):
                self.recorded_logits.setdefault(r, []).append(row.float().cpu())
        rows = self._sampler_inputs(out, sample_ids)
        tokens = self.sampler(logits, rows)
        return tokens, gather_logprobs(logits, tokens, sample_ids, list(rows.params))

    def _greedy_tokens(self, out: SchedulerOutput, plan: StepPlan, logits: torch.Tensor) -> torch.Tensor:
        """A lookahead step's tokens where some row is not the plain argmax: what the sampler picks for greedy
        rows (its penalties and masks, then argmax; one fused kernel on CUDA)."""
        rows = self._sampler_inputs(out, plan.sample_request_ids)
        return self.sampler.greedy(logits, rows, use_kernel=use_triton(logits, self.config.kernel_backend == "triton"))

    def release(self, out: SchedulerOutput) -> None:
        for h in out.free_encoder_hashes:
            self.encoder_outputs.pop(h, None)
            self.kept_tokens.free(h)
        for rid in out.finished_request_ids:
            self.positions.drop(rid)
            self.kept_tokens.forget(rid)

    def forget_request(self, request_id: str) -> None:
        """Called by the engine once a request has finished. Generators outlive preemption, so that a
        seeded request's draw sequence does not restart when it is recomputed."""
        self.generators.pop(request_id, None)
        self.positions.drop(request_id)
        self.kept_tokens.forget(request_id)

    def _encode_images(self, out: SchedulerOutput) -> tuple[MMItem, ...]:
        """Encode the step's new images in one batched call; returns the items encoded."""
        by_id = {s.request.request_id: s.request for s in out.scheduled}
        items: list[MMItem] = []
        for rid, indices in out.encoder_inputs.items():
            req: Request = by_id[rid]
            for i in indices:
                item = req.mm_items[i]
                if item.mm_hash not in self.encoder_outputs and all(x.mm_hash != item.mm_hash for x in items):
                    items.append(item)
        if not items:
            return ()
        encoded = tuple(items)
        # Compact pixels (the resized uint8 image) cross to the device as they are and are finished there.
        items = [it.finished(self.device) for it in items]
        encode = self.vision_graphs if self.vision_graphs is not None else self.model.encode_images
        for item, emb in zip(items, encode(items)):
            if emb.shape[0] != item.encoder_tokens:
                raise RuntimeError(f"vision tower gave {emb.shape[0]} embeddings for an image of "
                                   f"{item.encoder_tokens} tokens")
            self.encoder_outputs[item.mm_hash] = emb
        self.num_encoded_images += len(items)
        return encoded
