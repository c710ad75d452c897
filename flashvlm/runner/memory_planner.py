"""How much device memory the KV cache gets: the activation profile, and every reserve kept out of the budget.

budget = total x gpu_memory_utilization - memory already in use - activation peak - graph pools - cached image
embeddings; the KV cache takes budget // bytes per block, counted in the cache's own dtype (1 byte an element for
an FP8 cache, so the same memory holds twice the tokens of a bf16 one). Each reserve below is named after what it
holds; where one is an allowance rather than a measurement it says so, and the graph captures log what they really
took (`GraphSet.capture`), the figure to check it against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashvlm.attention.base import AttentionBackend
from flashvlm.attention.kv_quant import dtype_name, kv_cache_torch_dtype
from flashvlm.config import EngineConfig
from flashvlm.models.interfaces import VLModel
from flashvlm.request import MMItem, SamplingParams
from flashvlm.runner.inputs import single_sequence_context
from flashvlm.runner.sampler import Sampler, SamplerInputs
from flashvlm.runner.step_graphs import step_graph_max_tokens
from flashvlm.runner.token_mask import TokenMask, words_per_row

logger = logging.getLogger(__name__)

MiB = 2**20

PROFILE_HEADROOM = 1.1
"""The measured activation peak is scaled by this for allocator fragmentation (the caching allocator rounds
blocks and cannot always reuse a freed block for a larger request)."""

CPU_KV_SEQUENCES = 8
"""CPU engines skip the profile: their KV cache gets the memory this many max_model_len sequences (capped at
max_num_seqs) take in the model's dtype, plenty for tests and demos, small enough for a laptop (an FP8 cache holds
twice the tokens in it)."""

GRAPH_POOL_BASE_BYTES = 256 * MiB
"""Fixed part of each language-model graph pool (decode, step): the pool's segment rounding and what every graph
holds whatever its batch (RoPE tables, kernel workspaces). An allowance, not measured on its own; the decode
total it is part of was (DECODE_BYTES_PER_SEQ_LAYER)."""

LOGITS_COPIES = 3
"""Vocabulary-sized rows a captured batch keeps per sequence, at 4 bytes each: the LM head's logits and the
buffers around them, as an allowance of three float32 copies. With 152,064 tokens and 256 sequences: 446 MiB."""

DECODE_BYTES_PER_SEQ_LAYER = 128 * 1024
"""Decode-graph activations per sequence and decoder layer (hidden states, QKV, MLP, attention split-K
partials). Measured: Qwen2-VL-7B's 35 decode graphs up to 256 sequences took 1,422 MiB on the H200, above the
1,150 MiB that 64 KiB gave; 128 KiB reserves 1,598 MiB there (docs/BENCHMARKS.md, the sampler-memory run)."""

STEP_BYTES_PER_TOKEN = 64 * 1024
"""Step-graph activations per token of the largest bucket (hidden states, the packed MLP output). A bound that
errs large, not measured on its own: the full-budget activation profile scaled to that many tokens would be
exact."""

VISION_GRAPH_POOL_BYTES = 2**30
"""The vision graphs' one shared pool, sized for the largest batch they capture (VisionGraphs.max_patches =
16,384 patches: the tower's activations of one block at a time plus its output). An allowance, not measured."""

PIXEL_CACHE_BYTES = 256 * MiB
"""The input processor's cache of preprocessed pixels: about 110 compact 1008x756 Qwen images (2.3 MB each as
resized uint8, docs/caching.md), or 14 as float32 (18 MB). Held where the pixels were made (host memory, or the
device with preprocess_on_gpu); not counted in the KV budget."""


@dataclass
class GraphReserves:
    """The graph pools' share of the KV budget, per graph family (0 where the family is not captured)."""

    decode: int
    step: int
    vision: int

    @property
    def total(self) -> int:
        return self.decode + self.step + self.vision


class MemoryPlanner:
    """Sizes the KV cache for one engine: profiles the activation peak and subtracts the named reserves."""

    def __init__(self, config: EngineConfig, model: VLModel, dtype: torch.dtype, backend: AttentionBackend,
                 sampler: Sampler, max_model_len: int, use_cuda_graphs: bool) -> None:
        self.config, self.model, self.dtype, self.backend = config, model, dtype, backend
        self.sampler, self.max_model_len, self.use_cuda_graphs = sampler, max_model_len, use_cuda_graphs
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, dtype)

    def _element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def kv_bytes_per_block(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of one block across every layer, K and V, in the cache's dtype (or `dtype`)."""
        spec = self.model.kv_cache_spec()
        element = torch.empty((), dtype=dtype or self.kv_dtype).element_size()
        return 2 * spec.num_layers * self.block_size * spec.num_kv_heads * spec.head_dim * element

    def embedding_cache_bytes(self) -> int:
        """Cached image embeddings (the runner's encoder_outputs) live beside the KV cache, up to the encoder
        cache's budget in tokens (56 MiB on the 7B config by default)."""
        hidden = self.model.embedding_width
        return self.config.cache.encoder_cache_tokens * hidden * self._element_size()

    def determine_num_blocks(self, vision_items: Callable[[], list[MMItem]] | None = None) -> int:
        """From kv_cache_tokens if given; else on CUDA from gpu_memory_utilization after profiling (with the
        stand-in images `vision_items()` makes, only then: the largest allowed image is large)."""
        cache = self.config.cache
        if cache.kv_cache_tokens is not None:
            return cache.kv_cache_tokens // self.block_size + 1  # +1: block 0 is the null block
        if self.device.type != "cuda":
            tokens = self.max_model_len * min(self.config.scheduler.max_num_seqs, CPU_KV_SEQUENCES)
            return (tokens // self.block_size + 2) * self.kv_bytes_per_block(self.dtype) // self.kv_bytes_per_block()
        # Memory freed into torch's caching allocator at load (the float weights a quantization pass replaced) is
        # free, not in use: hand it back before reading what the device has left.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak = self.profile_peak_memory(vision_items() if vision_items is not None else [])
        budget = (total * cache.gpu_memory_utilization - (total - free) - peak - self.graph_reserves().total
                  - self.embedding_cache_bytes())
        num_blocks = int(budget // self.kv_bytes_per_block())
        if num_blocks < 2:
            raise RuntimeError(f"no memory left for the KV cache: {total / 2**30:.1f} GiB total, "
                               f"{(total - free) / 2**30:.1f} GiB in use, activation peak {peak / 2**30:.1f} GiB; "
                               "raise gpu_memory_utilization or lower max_num_batched_tokens or encoder_cache_tokens")
        logger.info("KV cache: %d blocks (%d tokens) in %s, activation peak %.2f GiB", num_blocks,
                    num_blocks * self.block_size, dtype_name(self.kv_dtype), peak / 2**30)
        return num_blocks

    def profile_peak_memory(self, vision_items: list[MMItem]) -> int:
        """Activation peak of a forward over a full token budget (measured on a throwaway KV cache) and of the
        vision tower on the heaviest image batch a step can hold, whichever is larger, with headroom."""
        peak = self._language_model_peak()
        if vision_items:
            vision_peak = self._vision_peak(vision_items)
            logger.info("activation peaks: language model %.2f GiB over %d tokens, vision tower %.2f GiB over %d "
                        "image(s) of %d tokens", peak / 2**30, self.config.scheduler.max_num_batched_tokens,
                        vision_peak / 2**30, len(vision_items), vision_items[0].num_tokens)
            peak = max(peak, vision_peak)
        return int(peak * PROFILE_HEADROOM)

    def _language_model_peak(self) -> int:
        n = self.config.scheduler.max_num_batched_tokens
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        # Profiled through the engine's own backend, so its kernels' workspace counts too.
        ctx = single_sequence_context(n, self.model.kv_cache_spec(), self.kv_dtype, self.device, self.block_size,
                                      self.backend)
        kv_bytes = sum(t.numel() * t.element_size() for t in ctx.kv_caches)
        with torch.inference_mode():
            embeds = self.model.embed_tokens(torch.zeros(n, dtype=torch.long, device=self.device))
            positions = torch.zeros((3, n) if self.model.uses_mrope else (n,), dtype=torch.long, device=self.device)
            hidden = self.model(embeds, positions, ctx)
            logits = self.model.compute_logits(hidden[-self.config.scheduler.max_num_seqs:])
            self.profile_sampler(logits)
            del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base - kv_bytes
        del ctx, embeds, hidden
        torch.cuda.empty_cache()
        return peak

    def _vision_peak(self, vision_items: list[MMItem]) -> int:
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            self.model.encode_images(vision_items)
        torch.cuda.synchronize(self.device)
        vision_peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        return vision_peak

    def profile_sampler(self, logits: torch.Tensor) -> None:
        """Sample every row with the costliest settings: top-p sorts the vocabulary and, with the penalty and
        min-p, keeps about a dozen (rows, vocab) float32 tensors alive (13x the logits at 152k vocab, measured
        on the H200), so a full batch of such requests must fit beside the KV cache. Every row is constrained by
        a structured-output mask too (one that allows everything: the same temporaries)."""
        rows = logits.shape[0]
        params = SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, repetition_penalty=1.1, min_tokens=1,
                                max_tokens=2)
        # The engine's generator (seeded by --seed) must give unseeded requests the same draws whether or not the
        # engine profiled: its state is put back.
        generator = self.sampler.default_generator
        state = generator.get_state()
        allow_all = TokenMask(list(range(rows)), torch.full((rows, words_per_row(logits.shape[1])), -1,
                                                            dtype=torch.int32))
        self.sampler(logits, SamplerInputs([params] * rows, [[0, 1]] * rows, [0] * rows, [(0,)] * rows,
                                           [None] * rows, allow_all))
        generator.set_state(state)

    def decode_graph_reserve(self) -> int:
        n = self.config.scheduler.max_num_seqs
        layers = self.model.kv_cache_spec().num_layers
        logits = LOGITS_COPIES * n * self.model.vocab_size * 4
        return GRAPH_POOL_BASE_BYTES + logits + n * layers * DECODE_BYTES_PER_SEQ_LAYER

    def graph_reserves(self) -> GraphReserves:
        """Memory kept out of the KV budget for the graph pools (none on eager engines)."""
        if not self.use_cuda_graphs:
            return GraphReserves(0, 0, 0)
        n = self.config.scheduler.max_num_seqs
        tokens = step_graph_max_tokens(self.config)
        step = 0
        if tokens:  # the step graphs' pool holds one forward of their largest bucket
            step = (GRAPH_POOL_BASE_BYTES + tokens * STEP_BYTES_PER_TOKEN
                    + LOGITS_COPIES * n * self.model.vocab_size * 4)
            # Input rows wider than the hidden state (Qwen3-VL's DeepStack columns): the graphs' input buffer and
            # the decoder's split of it grow with them, beyond what STEP_BYTES_PER_TOKEN allows.
            extra = self.model.embedding_width - self.model.language_model.embed_tokens.embedding_dim
            step += 2 * tokens * extra * self._element_size()
        vision = VISION_GRAPH_POOL_BYTES if self.config.vision_graphs > 0 and self.model.vision_graphable else 0
        return GraphReserves(self.decode_graph_reserve(), step, vision)
