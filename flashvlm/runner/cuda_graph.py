"""CUDA graphs for pure-decode steps: one graph per batch size of a ladder, replayed by copying the step's
inputs into fixed buffers.

A decode step of B sequences runs the graph of the smallest captured size >= B. Padding rows get
slot -1 (the KV write skips them) and seq_len 0 (decode attention returns zeros for them), so they never
touch real cache blocks. The graphs share one memory pool. Only the Triton attention backend is
capturable: the reference backend loops on the host.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from flashvlm.attention.base import AttentionBackend, AttentionMetadata
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import VLModel

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (padding wastes at most 7 rows)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(self, model: VLModel, backend: AttentionBackend, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        max_blocks = (max_model_len + block_size - 1) // block_size
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros((3, n) if model.uses_mrope else (n,), dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.max_model_len = max_model_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def _meta(self, size: int) -> AttentionMetadata:
        # Host fields describe the padded shape only; the Triton decode path reads device tensors.
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size], block_size=self.block_size,
            query_start_loc_host=list(range(size + 1)), seq_lens_host=[self.max_model_len] * size,
            max_query_len=1, max_seq_len=self.max_model_len)

    def _forward(self, size: int) -> torch.Tensor:
        ctx = ForwardContext(attn_meta=self._meta(size), kv_caches=self.kv_caches, backend=self.backend)
        embeds = self.model.embed_tokens(self.input_ids[:size])
        positions = self.positions[..., :size]
        return self.model.compute_logits(self.model(embeds, positions, ctx))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse the pool's blocks."""
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        for size in reversed(self.sizes):
            for _ in range(2):  # compile Triton kernels and settle allocations before capture
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[size] = self._forward(size)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info("captured %d decode graphs (batch %s) in %.1fs, %.0f MiB", len(self.sizes), self.sizes,
                    self.capture_seconds, self.memory_bytes / 2**20)

    def padded_size(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay for a decode batch of meta.num_seqs rows; returns logits (num_seqs, vocab)."""
        b = meta.num_seqs
        size = self.padded_size(b)
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[..., :b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[b:size].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[b:size].zero_()
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[size].replay()
        return self.outputs[size][:b]
