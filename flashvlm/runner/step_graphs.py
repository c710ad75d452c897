"""CUDA graphs for steps that are not pure decode: prefill chunks, cached-prefix extends (a repeated image, a
follow-up turn) and mixed prefill + decode batches, up to a token bound.

Why: an eager forward of a 28-layer model costs about 27 ms of host launch work on the H200 whatever the step's
size (docs/BENCHMARKS.md), so a 14-token extend took as long as a 1,038-token prefill. A graph
replays those launches in one call.

A step of N tokens in B sequences replays the graph of the smallest bucket (T, S) with T >= N and S >= B. The
step's embeddings (with image embeddings already spliced in, so the vision tower stays outside) and metadata are
copied into fixed buffers; padding tokens get slot -1 (their keys and values are never written) and belong to
no sequence, and padding sequences have no new tokens and length 0, so the attention kernel gives them no work.
Rows are independent through every layer, so padding never reaches a real row. The graph ends with the logits
of each sequence's last token.
"""

from __future__ import annotations

import dataclasses

import torch

from flashvlm.attention.base import AttentionBackend, AttentionStep, write_key_bias
from flashvlm.config import EngineConfig
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import VLModel
from flashvlm.runner.cuda_graph import GraphSet

MIN_GRAPH_TOKENS = 16
"""The smallest bucket's token count: an engine whose token bound is below it captures no step graphs."""
_SEQ_BUCKETS = (1, 4, 16, 64, 256)
_MIXED_MAX_TOKENS = 512
"""Above this, buckets serve a single sequence's prefill chunk only, in steps of _LARGE_STEP tokens."""
_LARGE_STEP = 64


def step_buckets(max_tokens: int, max_num_seqs: int) -> list[tuple[int, int]]:
    """(tokens, sequences) pairs. Up to 512 tokens: 16, 32, ... tokens x 1, 4, 16, 64, 256 and max_num_seqs
    sequences (never more sequences than tokens), for extends and mixed batches; padding wastes at most half.
    Above: one sequence, every 64 tokens up to max_tokens, for a whole prompt's prefill (an image and its
    question), where padding costs compute (a 1008x756 prompt of 1,038 tokens runs as 1,088: 5% more, against
    11% with 128-token steps); and mixed batches at
    1024 and 2048 tokens, where even doubled compute undercuts an eager step's ~27 ms of launches."""
    small_max = min(max_tokens, _MIXED_MAX_TOKENS)
    token_sizes, t = [], MIN_GRAPH_TOKENS
    while t < small_max:
        token_sizes.append(t)
        t *= 2
    if small_max >= MIN_GRAPH_TOKENS:
        token_sizes.append(small_max)
    seq_sizes = sorted({s for s in _SEQ_BUCKETS if s < max_num_seqs} | {max_num_seqs})
    buckets = [(t, s) for t in token_sizes for s in seq_sizes if s <= t]
    large = list(range(_MIXED_MAX_TOKENS + _LARGE_STEP, max_tokens, _LARGE_STEP))
    if max_tokens > _MIXED_MAX_TOKENS:
        large.append(max_tokens)
    mixed = [(t, s) for t in (1024, 2048) if t <= max_tokens for s in seq_sizes if 1 < s <= t]
    return buckets + [(t, 1) for t in large] + mixed


def step_graph_max_tokens(config: EngineConfig) -> int:
    """The largest step-graph bucket's token count for an engine, or 0 when it captures no step graphs."""
    tokens = min(config.prefill_graph_max_tokens, config.scheduler.max_num_batched_tokens)
    return tokens if tokens >= MIN_GRAPH_TOKENS else 0


class StepGraphs(GraphSet):
    name = "prefill/mixed-step graphs"

    def __init__(self, model: VLModel, backend: AttentionBackend, kv_caches: list[torch.Tensor], max_tokens: int,
                 max_num_seqs: int, max_model_len: int, block_size: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, slot_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size, self.max_model_len = block_size, max_model_len
        self.buckets = self.keys = step_buckets(max_tokens, max_num_seqs)
        t_max = max(t for t, _ in self.buckets)
        s_max = max(s for _, s in self.buckets)
        max_blocks = (max_model_len + block_size - 1) // block_size
        self.embeds = torch.zeros(t_max, hidden_size, dtype=dtype, device=device)
        self.positions = torch.zeros((3, t_max) if model.uses_mrope else (t_max,), dtype=torch.long, device=device)
        self.attn_buffers = backend.graph_buffers(t_max, s_max, max_blocks, block_size, device)
        self.sample_rows = torch.zeros(s_max, dtype=torch.long, device=device)
        self.slot_bias = slot_bias
        """The executor's per-slot key bias (proportional attention) or None; with it, `token_bias` holds the
        step's new tokens' bias (pruned images' kept tokens; 0 for text and padding), written with their keys."""
        self.token_bias = None if slot_bias is None else torch.zeros(t_max, dtype=torch.float32, device=device)

    def bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        """The smallest bucket holding the step, None if the step is larger than every bucket."""
        fits = [(t, s) for t, s in self.buckets if t >= num_tokens and s >= num_seqs]
        return min(fits) if fits else None

    def _forward(self, key: tuple[int, int]) -> torch.Tensor:
        tokens, seqs = key
        # Bounds for every step of the bucket: the prefill kernels (Triton's, FA4's) read device tensors and take
        # max_query_len and max_seq_len as bounds, here the bucket's token count and max_model_len.
        meta = self.backend.graph_metadata(self.attn_buffers, tokens, seqs, max_query_len=tokens,
                                           max_seq_len=self.max_model_len)
        if self.slot_bias is not None:
            write_key_bias(self.slot_bias, self.attn_buffers.slot_mapping[:tokens], self.token_bias[:tokens])
            meta = dataclasses.replace(meta, slot_bias=self.slot_bias)
        ctx = ForwardContext(attn_meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        hidden = self.model(self.embeds[:tokens], self.positions[..., :tokens], ctx)
        return self.model.compute_logits(hidden.index_select(0, self.sample_rows[:seqs]))

    def _reset_padding(self) -> None:
        self.backend.reset_graph_buffers(self.attn_buffers)
        self.attn_buffers.query_start_loc.zero_()
        self.sample_rows.zero_()

    def run(self, embeds: torch.Tensor, positions: torch.Tensor, step: AttentionStep,
            sample_rows: torch.Tensor, token_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (len(sample_rows), vocab) of the step's sampled rows; token_bias: the new tokens' key bias (with
        proportional attention). Without a captured graph for the bucket (CPU tests), the same padded body runs
        eagerly."""
        n, b, k = embeds.shape[0], step.num_seqs, sample_rows.shape[0]
        key = self.bucket(n, b)
        if key is None:
            raise ValueError(f"a step of {n} tokens in {b} sequences exceeds every graph bucket")
        tokens, seqs = key
        self.embeds[:n].copy_(embeds)
        self.embeds[n:tokens].zero_()
        self.positions[..., :n].copy_(positions)
        self.positions[..., n:tokens].zero_()
        if self.token_bias is not None:
            if token_bias is None:
                raise ValueError("graphs captured with proportional attention need each step's token_bias")
            self.token_bias[:n].copy_(token_bias)
            self.token_bias[n:tokens].zero_()
        self.backend.fill_graph_buffers(self.attn_buffers, step, tokens, seqs)
        self.sample_rows[:k].copy_(sample_rows)
        self.sample_rows[k:seqs].zero_()
        graph = self.graphs.get(key)
        if graph is None:
            with torch.inference_mode():
                return self._forward(key)[:k]
        graph.replay()
        return self.outputs[key][:k]
