"""CUDA graphs for pure-decode steps: one graph per batch size of a ladder, replayed by copying the step's
inputs into fixed buffers.

A decode step of B sequences runs the graph of the smallest captured size >= B. Padding rows get
slot -1 (the KV write skips them) and seq_len 0 (decode attention returns zeros for them), so they never
touch real cache blocks. The graphs share one memory pool. Only the Triton and FA4 attention backends are
capturable (both decode through the Triton kernel): the reference backend loops on the host.

The graphs' inputs live in two device buffers (int64: token ids, positions, slots; int32: sequence lengths,
block tables) with pinned host mirrors: a step writes its DecodeBatch into a mirror and sends it with one copy
per dtype, instead of a copy per array plus a device copy into each graph input. Two mirrors are used in turn,
each rewritten only once an event says its last copy ran. Each graph also returns the argmax of its logits, so
an all-greedy step needs no sampler kernels (runner/lookahead.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from flashvlm.attention.base import AttentionBackend, GraphAttentionBuffers, write_key_bias
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import VLModel
from flashvlm.runner.inputs import DecodeBatch

logger = logging.getLogger(__name__)


def capture_graph(fn: Callable[[], Any], pool: Any = None, error_mode: str = "global",
                  warmups: int = 2) -> tuple[torch.cuda.CUDAGraph, Any, Any]:
    """Run `fn` `warmups` times (Triton compiles, allocations settle), then capture it into `pool` (None: a new
    one). Returns the graph, the pool it used and fn's outputs, which the graph overwrites on every replay."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode=error_mode):
        outputs = fn()
    return graph, pool if pool is not None else graph.pool(), outputs


class GraphSet:
    """Graphs keyed by shape, captured largest first into one shared pool; owners fill `self.keys` and define
    `_forward(key)` over their fixed input buffers."""

    keys: list
    name: str = "graphs"

    def __init__(self) -> None:
        self.graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Any, Any] = {}
        """Each key's `_forward` outputs, which its graph overwrites on every replay."""
        self.pool = None
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def _forward(self, key: Any) -> torch.Tensor:
        raise NotImplementedError

    def _reset_padding(self) -> None:
        """Put the input buffers in a state where every row is padding (nothing written, nothing read)."""

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every key, largest first so smaller graphs reuse the pool's blocks."""
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        self._reset_padding()
        for key in sorted(self.keys, reverse=True):
            self.graphs[key], self.pool, self.outputs[key] = capture_graph(lambda k=key: self._forward(k), self.pool)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        logger.info("captured %d %s (up to %s) in %.1fs, %.0f MiB", len(self.graphs), self.name, max(self.keys),
                    self.capture_seconds, self.memory_bytes / 2**20)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (padding wastes at most 7 rows)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class _Mirror:
    """One pinned host copy of the decode graphs' input buffers, with numpy views in the same layout and the
    event after its last copy to the device (a mirror is rewritten only once that copy has run)."""

    def __init__(self, i64: torch.Tensor, i32: torch.Tensor, n: int, axes: int, max_blocks: int, pin: bool) -> None:
        self.h64 = torch.zeros(i64.shape, dtype=torch.long, pin_memory=pin)
        self.h32 = torch.zeros(i32.shape, dtype=torch.int32, pin_memory=pin)
        h64, h32 = self.h64.numpy(), self.h32.numpy()
        self.ids, self.pos, self.slots = h64[:n], h64[n:(1 + axes) * n].reshape(axes, n), h64[(1 + axes) * n:]
        self.lens, self.tables = h32[:n], h32[n:].reshape(n, max_blocks)
        self.slots.fill(-1)
        self.copied = torch.cuda.Event() if pin else None


class DecodeGraphs(GraphSet):
    name = "decode graphs"

    def __init__(self, model: VLModel, backend: AttentionBackend, kv_caches: list[torch.Tensor], max_num_seqs: int,
                 max_model_len: int, block_size: int, device: torch.device,
                 slot_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size = block_size
        self.slot_bias = slot_bias
        """The executor's per-slot key bias (proportional attention) or None: a decoded token is text, so each
        graph zeroes its new slots' bias and its attention reads everyone's."""
        self.sizes = self.keys = capture_sizes(max_num_seqs)
        n = self.sizes[-1]
        max_blocks = (max_model_len + block_size - 1) // block_size
        axes = 3 if model.uses_mrope else 1
        self._i64 = torch.zeros((2 + axes) * n, dtype=torch.long, device=device)
        self._i32 = torch.zeros(n + n * max_blocks, dtype=torch.int32, device=device)
        self.input_ids = self._i64[:n]
        self.positions = self._i64[n:(1 + axes) * n].view(axes, n) if axes == 3 else self._i64[n:2 * n]
        self.slot_mapping = self._i64[(1 + axes) * n:]
        self.seq_lens = self._i32[:n]
        self.block_tables = self._i32[n:].view(n, max_blocks)
        # Two mirrors, used in turn: the greedy pipeline stages step N+1 before step N's copy is known to be done.
        pin = device.type == "cuda"
        self._mirrors = [_Mirror(self._i64, self._i32, n, axes, max_blocks, pin) for _ in range(2)]
        self._turn = 0
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.max_model_len = max_model_len
        # The backend's graph buffers, as views of the packed ones: one staging copy per dtype fills them all.
        self.attn_buffers = GraphAttentionBuffers(query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                                                  block_tables=self.block_tables, slot_mapping=self.slot_mapping,
                                                  block_size=block_size)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits, their argmax): the greedy token comes out of the graph itself (bf16 argmax picks what the
        sampler's float32 argmax picks: the conversion is exact and keeps the order)."""
        # One new token per sequence, any context up to max_model_len.
        meta = self.backend.graph_metadata(self.attn_buffers, size, size, max_query_len=1,
                                           max_seq_len=self.max_model_len)
        if self.slot_bias is not None:
            write_key_bias(self.slot_bias, self.slot_mapping[:size])
            meta = dataclasses.replace(meta, slot_bias=self.slot_bias)
        ctx = ForwardContext(attn_meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        embeds = self.model.embed_tokens(self.input_ids[:size])
        positions = self.positions[..., :size]
        logits = self.model.compute_logits(self.model(embeds, positions, ctx))
        return logits, logits.argmax(dim=-1)

    def _reset_padding(self) -> None:
        self.backend.reset_graph_buffers(self.attn_buffers)

    def padded_size(self, num_seqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def stage(self, batch: DecodeBatch, input_ids: torch.Tensor | None = None) -> int:
        """Write the batch into the next host mirror and send it to the input buffers (one copy per dtype);
        `input_ids` (on the device) replaces the batch's token ids. Returns the padded size."""
        b = batch.num_seqs
        size = self.padded_size(b)
        if size is None:
            raise ValueError(f"a decode batch of {b} exceeds the largest graph ({self.sizes[-1]})")
        m = self._mirrors[self._turn]
        self._turn ^= 1
        if m.copied is not None:
            m.copied.synchronize()  # its previous copy has run (at once, except right after a discarded lookahead)
        m.ids[:b] = batch.token_ids
        m.pos[:, :b] = batch.positions  # every axis: generated tokens advance all three together
        m.slots[:b] = batch.slots
        m.slots[b:size] = -1
        m.lens[:b] = batch.seq_lens
        m.lens[b:size] = 0
        for i, blocks in enumerate(batch.block_ids):
            # Entries past a row's blocks may be stale: attention reads only the blocks its seq_len covers.
            m.tables[i, : len(blocks)] = blocks
        rows = m.tables.shape[1] * b
        self._i64.copy_(m.h64, non_blocking=True)
        self._i32[: self.seq_lens.shape[0] + rows].copy_(m.h32[: self.seq_lens.shape[0] + rows], non_blocking=True)
        if m.copied is not None:
            m.copied.record()
        if input_ids is not None:
            self.input_ids[:b].copy_(input_ids[:b])
        return size

    def replay(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the staged step: (logits, argmax) for `size` rows, in buffers the next replay of this size
        overwrites. Without a captured graph of that size (CPU tests) the same body runs eagerly."""
        graph = self.graphs.get(size)
        if graph is None:
            with torch.inference_mode():
                return self._forward(size)
        graph.replay()
        return self.outputs[size]

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Stage and replay a decode batch; returns the logits of its sampled rows (len(sample_rows), vocab)."""
        b = batch.num_seqs
        logits = self.replay(self.stage(batch))[0][:b]
        if len(batch.sample_rows) == b:  # sample_rows is an increasing subset of range(b)
            return logits
        return logits.index_select(0, torch.as_tensor(batch.sample_rows, device=logits.device))
