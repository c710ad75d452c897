"""The language model's part of a step: which execution path runs it, decided in one place, and running it.

Paths, in the order they are tried:
- lookahead: an all-greedy pure-decode batch within the decode graphs' ladder, no row asking for logprobs,
  through the greedy pipeline (the next step is launched before this one is read; runner/lookahead.py);
- decode graph: any other pure-decode batch of generated tokens within the ladder (runner/cuda_graph.py);
- step graph: a prefill, cached-prefix or mixed step within the step graphs' buckets (runner/step_graphs.py);
- eager: everything else, and every step of an engine without CUDA graphs.
A step that does not take the lookahead drops the lookahead in flight, so a lookahead never outlives a change of
batch. The executor owns the language-model graphs; the runner owns the vision tower and its graphs.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch

from flashvlm.attention.base import AttentionBackend, write_key_bias
from flashvlm.config import EngineConfig
from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import VLModel
from flashvlm.runner.cuda_graph import DecodeGraphs
from flashvlm.runner.inputs import (
    DecodeBatch,
    PositionStore,
    StepInputs,
    decode_batch,
    decode_step_inputs,
    general_step_inputs,
)
from flashvlm.runner.lookahead import GreedyDecodePipeline, TokenSelector, pipeline_eligible
from flashvlm.runner.pruned_tokens import KeptTokens
from flashvlm.runner.step_graphs import StepGraphs, step_graph_max_tokens


class ExecutionPath(enum.Enum):
    LOOKAHEAD = "lookahead"
    DECODE_GRAPH = "decode graph"
    STEP_GRAPH = "step graph"
    EAGER = "eager"


@dataclass
class StepPlan:
    """One step's path and what that path runs on."""

    path: ExecutionPath
    batch: DecodeBatch | None
    """The step as a DecodeBatch when it is pure decode of generated tokens."""
    inputs: StepInputs | None
    """The flat inputs (step-graph and eager paths only)."""

    @property
    def sample_request_ids(self) -> list[str]:
        return self.inputs.sample_request_ids if self.inputs is not None else self.batch.sample_request_ids


def splice_image_embeddings(out: SchedulerOutput, embeds: torch.Tensor, encoder_outputs: dict[str, torch.Tensor],
                            kept_tokens: KeptTokens, token_bias: torch.Tensor | None = None) -> None:
    """Write each scheduled chunk's image embeddings over its placeholder rows of the flat batch (a pruned
    image's placeholders take its kept embeddings, in order), and with proportional attention the kept tokens'
    key bias into `token_bias` (one per row of the batch, zero elsewhere)."""
    row = 0
    for s in out.scheduled:
        a, b = s.start, s.end
        for item in s.request.mm_items:
            lo, hi = max(a, item.offset), min(b, item.end)
            if lo < hi:
                full = encoder_outputs[item.mm_hash]
                rows = kept_tokens.image_rows(item, full, lo - item.offset, hi - item.offset)
                embeds[row + lo - a: row + hi - a] = rows.to(embeds.dtype)
                bias = None if token_bias is None else kept_tokens.image_bias(item, full, lo - item.offset,
                                                                              hi - item.offset)
                if bias is not None:
                    token_bias[row + lo - a: row + hi - a] = bias
        row += b - a


class StepExecutor:
    def __init__(self, model: VLModel, backend: AttentionBackend, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.backend, self.block_size = model, backend, block_size
        self.dtype, self.device = dtype, device
        self.kv_caches: list[torch.Tensor] = []
        self.slot_bias: torch.Tensor | None = None
        """(slots,) float32 with proportional attention: each KV slot's key bias (attention/base.py), written for
        every step's new tokens (here for eager steps, inside the graphs for theirs); the runner allocates it with
        the KV cache, before any graph is captured."""
        self.decode_graphs: DecodeGraphs | None = None
        self.step_graphs: StepGraphs | None = None
        """Graphs for prefill and mixed steps up to config.prefill_graph_max_tokens (CUDA only)."""
        self.pipeline: GreedyDecodePipeline | None = None
        """All-greedy decode steps through the decode graphs, the next launched before this one is read."""

    # ---- graph setup ---------------------------------------------------------------------------
    def capture_graphs(self, config: EngineConfig, max_model_len: int) -> None:
        """Capture the decode graphs (and the lookahead on them) and the step graphs over `self.kv_caches`."""
        sched = config.scheduler
        self.decode_graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, sched.max_num_seqs,
                                          max_model_len, self.block_size, self.device, self.slot_bias)
        self.decode_graphs.capture()
        if config.decode_lookahead:
            self.pipeline = GreedyDecodePipeline(self.decode_graphs, self.block_size, max_model_len)
        max_tokens = step_graph_max_tokens(config)
        if max_tokens:
            self.step_graphs = self.build_step_graphs(max_tokens, sched.max_num_seqs, max_model_len)
            self.step_graphs.capture()

    def build_step_graphs(self, max_tokens: int, max_num_seqs: int, max_model_len: int) -> StepGraphs:
        hidden = self.model.embedding_width
        return StepGraphs(self.model, self.backend, self.kv_caches, max_tokens, max_num_seqs, max_model_len,
                          self.block_size, hidden, self.dtype, self.device, self.slot_bias)

    # ---- the one decision ----------------------------------------------------------------------
    def plan(self, out: SchedulerOutput, positions: PositionStore, allow_lookahead: bool = True) -> StepPlan:
        """The step's execution path. Builds only the inputs that path reads (none for the decode graphs, whose
        staging writes the DecodeBatch straight into their buffers)."""
        batch = decode_batch(out, positions, self.block_size)
        decode_graph = (batch is not None and self.decode_graphs is not None and not out.encoder_inputs
                        and self.decode_graphs.padded_size(batch.num_seqs) is not None)
        if decode_graph and self.pipeline is not None and allow_lookahead and pipeline_eligible(out, batch):
            return StepPlan(ExecutionPath.LOOKAHEAD, batch, None)
        if self.pipeline is not None:
            self.pipeline.drop()
        if decode_graph:
            return StepPlan(ExecutionPath.DECODE_GRAPH, batch, None)
        if batch is not None:
            inputs = decode_step_inputs(batch, self.block_size, self.device)
        else:
            inputs = general_step_inputs(out, positions, self.block_size, self.device)
        step = inputs.attn_step
        if self.step_graphs is not None and self.step_graphs.bucket(inputs.input_ids.shape[0],
                                                                    step.num_seqs) is not None:
            return StepPlan(ExecutionPath.STEP_GRAPH, batch, inputs)
        return StepPlan(ExecutionPath.EAGER, batch, inputs)

    # ---- running a plan ------------------------------------------------------------------------
    def lookahead(self, out: SchedulerOutput, plan: StepPlan, select: TokenSelector) -> list[int]:
        """A LOOKAHEAD plan's tokens, one per row (the pipeline reads them; `select` chooses them where a row is
        not the plain argmax)."""
        return self.pipeline.step(out, plan.batch, waiting=out.may_admit, select=select)

    def logits(self, out: SchedulerOutput, plan: StepPlan, encoder_outputs: dict[str, torch.Tensor],
               kept_tokens: KeptTokens) -> torch.Tensor:
        """Logits of the step's sampled rows (in plan.sample_request_ids order) for every path but LOOKAHEAD."""
        if plan.path is ExecutionPath.DECODE_GRAPH:
            return self.decode_graphs.run(plan.batch)
        inputs = plan.inputs
        embeds = self.model.embed_tokens(inputs.input_ids)
        token_bias = None
        if self.slot_bias is not None:
            token_bias = torch.zeros(embeds.shape[0], dtype=torch.float32, device=embeds.device)
        # The vision tower's output enters before any graph, so graphs and eager steps splice alike.
        splice_image_embeddings(out, embeds, encoder_outputs, kept_tokens, token_bias)
        if plan.path is ExecutionPath.STEP_GRAPH:
            return self.step_graphs.run(embeds, inputs.positions, inputs.attn_step, inputs.sample_rows, token_bias)
        meta = self.backend.build_metadata(inputs.attn_step)
        if token_bias is not None:
            write_key_bias(self.slot_bias, meta.slot_mapping, token_bias)
            meta = dataclasses.replace(meta, slot_bias=self.slot_bias)
        ctx = ForwardContext(attn_meta=meta, kv_caches=self.kv_caches, backend=self.backend)
        hidden = self.model(embeds, inputs.positions, ctx)
        return self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
