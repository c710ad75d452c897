"""Owns the device side: the model, the KV cache, image embeddings in flight, and one step's execution."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashvlm.attention.base import get_backend
from flashvlm.config import EngineConfig
from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import VLModel
from flashvlm.request import MMItem, Request, SamplingParams
from flashvlm.runner.cuda_graph import DecodeGraphs
from flashvlm.runner.inputs import (
    DecodeBatch,
    PositionStore,
    StepInputs,
    decode_batch,
    decode_step_inputs,
    general_step_inputs,
    single_sequence_context,
)
from flashvlm.runner.lookahead import GreedyDecodePipeline, pipeline_eligible
from flashvlm.runner.sampler import Sampler, make_generator
from flashvlm.runner.step_graphs import StepGraphs
from flashvlm.runner.vision_graphs import VisionGraphs

logger = logging.getLogger(__name__)


@dataclass
class StepTimings:
    """Where the last step's time went. Device work is timed with CUDA events on GPU (read after the
    step's one host sync, so timing adds no sync), with host clocks on CPU."""

    vision_s: float = 0.0
    forward_s: float = 0.0
    """Embedding, language-model forward, logits and sampling."""
    num_images: int = 0


class _Timer:
    """A start/stop pair of CUDA events, or host clock readings on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.start_event.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end_event.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        """Call only after the device work has finished (after the step's host sync)."""
        if self.cuda:
            return self.start_event.elapsed_time(self.end_event) / 1e3
        return self.t1 - self.t0

    def finished(self) -> bool:
        """Whether the device has passed the stop reading (the start is before it on the same stream)."""
        return not self.cuda or self.end_event.query()


class ModelRunner:
    def __init__(self, config: EngineConfig, model: VLModel, dtype: torch.dtype, *, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        """EngineLimits.max_model_len: the graphs' longest sequence and the decode split bound."""
        self.model = model
        self.dtype = dtype
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.backend = get_backend(config.attention_backend)
        self.use_cuda_graphs = not config.enforce_eager and self.device.type == "cuda" and self.backend.graph_capturable
        if self.backend.graph_capturable:
            # Decode split counts follow the batch shape only, never the step's lengths: graphs need that, and
            # eager steps use the same splits so both paths reduce in the same order (identical bf16 results).
            self.backend.max_seq_len_bound = max_model_len
        self.graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        """Graphs for prefill and mixed steps up to config.prefill_graph_max_tokens (CUDA only)."""
        self.vision_graphs: VisionGraphs | None = None
        """Vision-tower graphs for recurring image shapes (CUDA, models whose tower is capturable)."""
        self.pipeline: GreedyDecodePipeline | None = None
        """All-greedy decode steps through the decode graphs, the next launched before this one is read."""
        # Unseeded requests draw from the engine's own generator, never torch's global one, so other torch
        # code in the process cannot change an engine's samples, and engines do not share a stream.
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.model.seed))
        self.kv_caches: list[torch.Tensor] = []
        self.positions = PositionStore()
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        """Vision embeddings by mm_hash; the scheduler's EncoderCacheManager decides what stays."""
        self.num_encoded_images = 0
        """Images run through the vision tower since start (cache tests and stats)."""
        self.generators: dict[str, torch.Generator | None] = {}
        self.last_timings = StepTimings()
        self._vision_timer = _Timer(self.device)
        # Two forward timers, alternating by step: a lookahead step stops its timer while the step it launched
        # is still running, so it reports the previous step's time, read from the other timer.
        self._forward_timers = (_Timer(self.device), _Timer(self.device))
        self._step_parity = 0
        self.record_logits = False
        """Test hook: keep the logits of every sampled row in `recorded_logits`, by request id."""
        self.recorded_logits: dict[str, list[torch.Tensor]] = {}

    # ---- KV cache ------------------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        spec = self.model.kv_cache_spec()
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * spec.num_layers * self.block_size * spec.num_kv_heads * spec.head_dim * elem

    def determine_num_blocks(self, vision_items: Callable[[], list[MMItem]] | None = None) -> int:
        """From kv_cache_tokens if given; else on CUDA from gpu_memory_utilization after profiling (with the
        stand-in images `vision_items()` makes, only then: the largest allowed image is large)."""
        cache = self.config.cache
        if cache.kv_cache_tokens is not None:
            return cache.kv_cache_tokens // self.block_size + 1  # +1: block 0 is the null block
        if self.device.type != "cuda":
            sched = self.config.scheduler
            tokens = self.max_model_len * min(sched.max_num_seqs, 8)
            return tokens // self.block_size + 2
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self.profile_peak_memory(vision_items() if vision_items is not None else [])
        # Cached image embeddings (runner.encoder_outputs) live beside the KV cache, up to the encoder cache's budget.
        hidden = self.model.language_model.embed_tokens.embedding_dim
        embeddings = cache.encoder_cache_tokens * hidden * torch.empty((), dtype=self.dtype).element_size()
        budget = (total * cache.gpu_memory_utilization - (total - free) - peak - self.graph_memory_reserve()
                  - embeddings)
        num_blocks = int(budget // self.kv_bytes_per_block())
        if num_blocks < 2:
            raise RuntimeError(f"no memory left for the KV cache: {total / 2**30:.1f} GiB total, "
                               f"{(total - free) / 2**30:.1f} GiB in use, activation peak {peak / 2**30:.1f} GiB; "
                               "raise gpu_memory_utilization or lower max_num_batched_tokens or encoder_cache_tokens")
        logger.info("KV cache: %d blocks (%d tokens), activation peak %.2f GiB", num_blocks,
                    num_blocks * self.block_size, peak / 2**30)
        return num_blocks

    def profile_peak_memory(self, vision_items: list[MMItem]) -> int:
        """Activation peak of a forward over a full token budget (measured on a throwaway KV cache) and of the
        vision tower on the heaviest image batch a step can hold, whichever is larger."""
        n = self.config.scheduler.max_num_batched_tokens
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        # Profiled through the engine's own backend, so its kernels' workspace counts too.
        ctx = single_sequence_context(n, self.model.kv_cache_spec(), self.dtype, self.device, self.block_size,
                                      self.backend)
        kv_bytes = sum(t.numel() * t.element_size() for t in ctx.kv_caches)
        with torch.inference_mode():
            embeds = self.model.embed_tokens(torch.zeros(n, dtype=torch.long, device=self.device))
            positions = torch.zeros((3, n) if self.model.uses_mrope else (n,), dtype=torch.long, device=self.device)
            hidden = self.model(embeds, positions, ctx)
            logits = self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs:])
            self._profile_sampler(logits)
            del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - kv_bytes
        del ctx, embeds, hidden
        torch.cuda.empty_cache()
        if vision_items:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            with torch.inference_mode():
                self.model.encode_images(vision_items)
            torch.cuda.synchronize(self.device)
            vision_peak = torch.cuda.max_memory_allocated(self.device) - base
            torch.cuda.empty_cache()
            logger.info("activation peaks: language model %.2f GiB over %d tokens, vision tower %.2f GiB over %d "
                        "image(s) of %d tokens", peak / 2**30, n, vision_peak / 2**30, len(vision_items),
                        vision_items[0].num_tokens)
            peak = max(peak, vision_peak)
        return int(peak * 1.1)  # headroom for fragmentation

    def _profile_sampler(self, logits: torch.Tensor) -> None:
        """Sample every row with the costliest settings: top-p sorts the vocabulary and, with the penalty and
        min-p, keeps about a dozen (rows, vocab) float32 tensors alive (13x the logits at 152k vocab, measured
        on the H200), so a full batch of such requests must fit beside the KV cache."""
        rows = logits.shape[0]
        params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1, min_tokens=1,
                                max_tokens=2)
        # The engine's generator (seeded by --seed) must give unseeded requests the same draws whether or not the
        # engine profiled: its state is put back.
        generator = self.sampler.default_generator
        state = generator.get_state()
        self.sampler(logits, [params] * rows, [[0, 1]] * rows, [0] * rows, [(0,)] * rows, [None] * rows)
        generator.set_state(state)

    def graph_memory_reserve(self) -> int:
        """Memory kept out of the KV budget for the decode graphs' pool: logits and activations of the
        largest captured batch, with room to spare (the measured figure is logged after capture)."""
        if not self.use_cuda_graphs:
            return 0
        n = self.config.scheduler.max_num_seqs
        decode = self._decode_graph_reserve()
        # The step graphs' pool holds one forward of their largest bucket: the activation profile of that many
        # tokens scaled from the full-budget profile would be exact; this bound (hidden states, packed MLP
        # output, logits) errs large.
        tokens = min(self.config.prefill_graph_max_tokens, self.config.scheduler.max_num_batched_tokens)
        step = 256 * 2**20 + tokens * 2**16 + 3 * n * self.model.vocab_size * 4 if tokens >= 16 else 0
        # Vision graphs share one pool sized by the largest captured batch (VisionGraphs.max_patches patches).
        vision = 2**30 if self.config.vision_graphs > 0 and self.model.vision_graphable else 0
        return decode + step + vision

    def _decode_graph_reserve(self) -> int:
        # 128 KiB per sequence and layer: Qwen2-VL-7B's 35 graphs up to 256 sequences took 1,422 MiB on the H200
        # (2026-11-29), above the 1,150 MiB that 64 KiB gave.
        n = self.config.scheduler.max_num_seqs
        return 256 * 2**20 + 3 * n * self.model.vocab_size * 4 + n * self.model.kv_cache_spec().num_layers * 2**17

    def allocate_kv_cache(self, num_blocks: int) -> None:
        spec = self.model.kv_cache_spec()
        self.kv_caches = [torch.zeros(2, num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                                      dtype=self.dtype, device=self.device) for _ in range(spec.num_layers)]
        if self.use_cuda_graphs:
            sched = self.config.scheduler
            self.graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, sched.max_num_seqs,
                                       self.max_model_len, self.block_size, self.device)
            self.graphs.capture()
            reserve = self._decode_graph_reserve()
            if self.graphs.memory_bytes > reserve:
                # The KV cache is already sized: say so rather than fail later under load.
                logger.warning("the decode graphs took %.0f MiB, above the %.0f MiB kept for them; lower "
                               "gpu_memory_utilization if steps run out of memory", self.graphs.memory_bytes / 2**20,
                               reserve / 2**20)
            if self.config.decode_lookahead:
                self.pipeline = GreedyDecodePipeline(self.graphs, self.block_size, self.max_model_len)
            if self.config.vision_graphs > 0 and self.model.vision_graphable:
                self.vision_graphs = VisionGraphs(self.model.encode_images, self.device, self.dtype,
                                                  max_graphs=self.config.vision_graphs)
            max_tokens = min(self.config.prefill_graph_max_tokens, sched.max_num_batched_tokens)
            if max_tokens >= 16:
                self.step_graphs = self.build_step_graphs(max_tokens)
                self.step_graphs.capture()

    def build_step_graphs(self, max_tokens: int) -> StepGraphs:
        sched = self.config.scheduler
        hidden = self.model.language_model.embed_tokens.embedding_dim
        return StepGraphs(self.model, self.backend, self.kv_caches, max_tokens, sched.max_num_seqs,
                          self.max_model_len, self.block_size, hidden, self.dtype, self.device)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        """Run one scheduled step; returns the sampled token of each request that reached its end."""
        self.release(out)
        for s in out.scheduled:
            req = s.request
            if not self.positions.has(req.request_id):
                pos, delta = self.model.prompt_positions(req.prompt_token_ids, req.mm_items)
                self.positions.put(req.request_id, pos, delta)
            if req.request_id not in self.generators:
                self.generators[req.request_id] = make_generator(req.sampling_params.seed, self.device)
        num_images = 0
        if out.encoder_inputs:
            self._vision_timer.start()
            num_images = self._encode_images(out)
            self._vision_timer.stop()

        timer, previous_timer = self._forward_timers[self._step_parity], self._forward_timers[1 - self._step_parity]
        self._step_parity ^= 1
        timer.start()
        batch = decode_batch(out, self.positions, self.block_size)
        if (self.pipeline is not None and batch is not None and not self.record_logits
                and self._decode_graph_fits(out, batch) and pipeline_eligible(out, batch)):
            tokens = self.pipeline.step(out, batch, waiting=out.may_admit)
            timer.stop()  # brackets the lookahead launched here: on average one step's time
            forward_s = previous_timer.seconds() if previous_timer.finished() else self.last_timings.forward_s
            self.last_timings = StepTimings(forward_s=forward_s, num_images=num_images)
            return dict(zip(batch.sample_request_ids, tokens))
        if self.pipeline is not None:
            self.pipeline.drop()
        logits, sample_ids = self._forward_logits(out, batch)
        sampled: dict[str, int] = {}
        if sample_ids:
            by_id = {s.request.request_id: s.request for s in out.scheduled}
            reqs = [by_id[r] for r in sample_ids]
            if self.record_logits:
                for r, row in zip(sample_ids, logits):
                    self.recorded_logits.setdefault(r, []).append(row.float().cpu())
            tokens = self.sampler(
                logits, [r.sampling_params for r in reqs],
                [r.all_token_ids if r.sampling_params.repetition_penalty != 1.0 else () for r in reqs],
                [len(r.output_token_ids) for r in reqs], [r.eos_token_ids for r in reqs],
                [self.generators.get(r.request_id) for r in reqs])
            timer.stop()
            sampled = dict(zip(sample_ids, tokens.tolist()))  # the step's one host sync
        else:
            timer.stop()
            if self.device.type == "cuda":
                timer.end_event.synchronize()
        self.last_timings = StepTimings(vision_s=self._vision_timer.seconds() if num_images else 0.0,
                                        forward_s=timer.seconds(), num_images=num_images)
        return sampled

    def _forward_logits(self, out: SchedulerOutput, batch: DecodeBatch | None) -> tuple[torch.Tensor, list[str]]:
        """Logits of the step's sampled rows and their request ids: a decode graph, a prefill/mixed-step graph,
        or eager (`batch`: the step as a DecodeBatch if it is pure decode)."""
        if batch is not None and self._decode_graph_fits(out, batch):
            return self.graphs.run(batch), batch.sample_request_ids
        if batch is not None:
            inputs = decode_step_inputs(batch, self.block_size, self.device)
        else:
            inputs = general_step_inputs(out, self.positions, self.block_size, self.device)
        return self._forward_inputs(out, inputs), inputs.sample_request_ids

    def _forward_inputs(self, out: SchedulerOutput, inputs: StepInputs) -> torch.Tensor:
        meta = inputs.attn_meta
        embeds = self.model.embed_tokens(inputs.input_ids)
        self._splice_image_embeddings(out, embeds)  # the vision tower's output enters before any graph
        if self.step_graphs is not None and self.step_graphs.bucket(embeds.shape[0], meta.num_seqs) is not None:
            return self.step_graphs.run(embeds, inputs.positions, meta, inputs.sample_rows)
        ctx = ForwardContext(attn_meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        hidden = self.model(embeds, inputs.positions, ctx)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))

    def _decode_graph_fits(self, out: SchedulerOutput, batch: DecodeBatch) -> bool:
        """The decode graphs serve generated tokens (never image rows) of batches within their ladder."""
        return (self.graphs is not None and not out.encoder_inputs
                and self.graphs.padded_size(batch.num_seqs) is not None)

    def release(self, out: SchedulerOutput) -> None:
        for h in out.free_encoder_hashes:
            self.encoder_outputs.pop(h, None)
        for rid in out.finished_request_ids:
            self.positions.drop(rid)

    def forget_request(self, request_id: str) -> None:
        """Called by the engine once a request has finished. Generators outlive preemption, so that a
        seeded request's draw sequence does not restart when it is recomputed."""
        self.generators.pop(request_id, None)
        self.positions.drop(request_id)

    def _encode_images(self, out: SchedulerOutput) -> int:
        """Encode the step's new images in one batched call; returns how many were encoded."""
        by_id = {s.request.request_id: s.request for s in out.scheduled}
        items: list[MMItem] = []
        for rid, indices in out.encoder_inputs.items():
            req: Request = by_id[rid]
            for i in indices:
                item = req.mm_items[i]
                if item.mm_hash not in self.encoder_outputs and all(x.mm_hash != item.mm_hash for x in items):
                    items.append(item)
        if not items:
            return 0
        # Compact pixels (the resized uint8 image) cross to the device as they are and are finished there.
        items = [dataclasses.replace(it, pixel_values=it.model_pixels(self.device), pixel_decoder=None)
                 if it.pixel_decoder is not None else it for it in items]
        encode = self.vision_graphs if self.vision_graphs is not None else self.model.encode_images
        for item, emb in zip(items, encode(items)):
            if emb.shape[0] != item.num_tokens:
                raise RuntimeError(f"vision tower gave {emb.shape[0]} embeddings for an image with "
                                   f"{item.num_tokens} placeholders")
            self.encoder_outputs[item.mm_hash] = emb
        self.num_encoded_images += len(items)
        return len(items)

    def _splice_image_embeddings(self, out: SchedulerOutput, embeds: torch.Tensor) -> None:
        row = 0
        for s in out.scheduled:
            a, b = s.start, s.end
            for item in s.request.mm_items:
                lo, hi = max(a, item.offset), min(b, item.end)
                if lo < hi:
                    emb = self.encoder_outputs[item.mm_hash]
                    embeds[row + lo - a: row + hi - a] = emb[lo - item.offset: hi - item.offset].to(embeds.dtype)
            row += b - a
