"""Greedy decode with a one-step lookahead: the next decode step is launched before this one's tokens are read.

A decode step's host work (reading its tokens back, the scheduler's update, detokenizing, the next schedule,
staging its inputs) otherwise runs while the GPU idles: about 0.3 ms of a 4.9 ms step on an H200 at batch 1.
When every row of a pure-decode batch is greedy, the next step of the same batch (positions + 1, same blocks) can
be launched at once with this step's tokens fed on the device. The engine then reads this step's tokens and does
its host work while the GPU computes the next step.

A row's greedy token is the decode graph's own argmax unless a logits processor changes it (a structured-output
mask, the min_tokens ban, a repetition penalty: `Sampler.is_plain_argmax`). A step with such a row keeps the
graph's logits, and its tokens are chosen when the engine reaches that step (`TokenSelector`: the sampler's
penalties and masks, then argmax): by then the host has read the previous tokens and advanced the grammars, so
the step's mask is built while the GPU still runs the step's forward, and the step after it is launched behind.

The scheduler decides as before (it only reserves each decoding request's next block early when blocks are
plentiful: `lookahead_slots`). If its next step is exactly the step launched ahead (same requests in the same
order, positions, slots and lengths), the runner takes that step's tokens; otherwise (a request finished or
was preempted, a new one was admitted) the lookahead is dropped. Its only side effect was writing the KV of
each row's newest token into that row's next slot, which the real step writes identically, or which lies past
the computed tokens of a finished request, in a block that is not in the prefix cache (only full, computed
blocks are). A lookahead is launched only when every row continues (no max_tokens or max_model_len end this
step), its next slot is in a block it already holds, and no waiting request could take a free batch slot, so
it is dropped mostly when a request ends on EOS, a stop string or its grammar's end. Any step that does not go
through the pipeline drops the lookahead first, so a lookahead never outlives a change of batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.runner.cuda_graph import DecodeGraphs
from flashvlm.runner.inputs import DecodeBatch
from flashvlm.runner.sampler import Sampler

TokenSelector = Callable[[torch.Tensor], torch.Tensor]
"""A step's logits (one row per request, in the step's order, on the device) -> its greedy tokens (int64, device),
with the sampler's penalties and masks applied as they stand when the engine reaches that step."""


def pipeline_eligible(out: SchedulerOutput, batch: DecodeBatch) -> bool:
    """Every row samples greedily and none asks for log-probabilities (the pipeline reads back tokens only)."""
    if len(batch.sample_rows) != batch.num_seqs:
        return False
    return all(s.request.sampling_params.greedy and s.request.sampling_params.logprobs is None
               for s in out.scheduled)


def ranks_agree_ahead(out: SchedulerOutput, tensor_parallel_size: int) -> bool:
    """Whether every rank of a tensor-parallel engine picks the same tokens for a step launched ahead. Each rank
    feeds its own picks to the next step, and only rank 0 holds the grammar matchers: with tensor_parallel_size > 1
    a constrained row keeps its batch off the lookahead (the workers then take rank 0's tokens from the step)."""
    return tensor_parallel_size == 1 or all(s.request.sampling_params.structured_outputs is None
                                            for s in out.scheduled)


def _plain_argmax(out: SchedulerOutput, steps_ahead: int) -> bool:
    """Whether every row's token `steps_ahead` steps after `out`'s is the plain argmax of its logits."""
    return all(Sampler.is_plain_argmax(s.request.sampling_params, len(s.request.output_token_ids) + steps_ahead)
               for s in out.scheduled)


@dataclass
class _Launched:
    batch: DecodeBatch
    logits: torch.Tensor | None = None
    """(num_seqs, vocab) on the device, kept when the tokens are chosen at the step itself (`TokenSelector`)."""
    tokens: torch.Tensor | None = None
    """(num_seqs,) int64 on the device: this step's greedy tokens, kept apart from the graph's output buffer."""
    host: torch.Tensor | None = None
    done: torch.cuda.Event | None = None

    def choose(self, tokens: torch.Tensor) -> None:
        """Take the step's tokens (on the device) and start their copy to the host."""
        self.tokens, self.logits = tokens, None
        cuda = tokens.is_cuda
        self.host = torch.empty(tokens.shape[0], dtype=torch.int64, pin_memory=cuda)
        self.host.copy_(tokens, non_blocking=cuda)
        if cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()

    def same_step(self, batch: DecodeBatch) -> bool:
        a = self.batch
        return (a.sample_request_ids == batch.sample_request_ids and a.positions == batch.positions
                and a.slots == batch.slots and a.seq_lens == batch.seq_lens)


class GreedyDecodePipeline:
    def __init__(self, graphs: DecodeGraphs, block_size: int, max_model_len: int) -> None:
        self.graphs, self.block_size, self.max_model_len = graphs, block_size, max_model_len
        self._ahead: _Launched | None = None
        self.num_lookaheads = 0
        self.num_dropped = 0
        """Lookaheads launched, and those the scheduler's next step did not match (wasted GPU work)."""

    def step(self, out: SchedulerOutput, batch: DecodeBatch, waiting: bool, select: TokenSelector) -> list[int]:
        """This step's tokens (one per row), launching the next step ahead when it can. `select` chooses the
        tokens of a step some row of which is not the plain argmax."""
        ahead, self._ahead = self._ahead, None
        plain = _plain_argmax(out, 0)
        if ahead is not None and ahead.same_step(batch) and (plain or ahead.logits is not None):
            current = ahead
        else:
            self.num_dropped += ahead is not None
            current = self._launch(batch, None, keep_logits=not plain)
        if current.logits is not None:
            current.choose(select(current.logits))
        following = None if waiting else self._next_batch(out, batch)
        if following is not None:
            self._ahead = self._launch(following, current.tokens, keep_logits=not _plain_argmax(out, 1))
            self.num_lookaheads += 1
        return current.read()

    def drop(self) -> None:
        """Forget a lookahead (the engine is about to run something else)."""
        if self._ahead is not None:
            self.num_dropped += 1
            self._ahead = None

    def _launch(self, batch: DecodeBatch, input_ids: torch.Tensor | None, keep_logits: bool) -> _Launched:
        b = batch.num_seqs
        logits, greedy = self.graphs.replay(self.graphs.stage(batch, input_ids))
        # Clones: the graph's buffers are overwritten by the next replay of this size.
        if keep_logits:
            return _Launched(batch, logits=logits[:b].clone())
        launched = _Launched(batch)
        launched.choose(greedy[:b].clone())
        return launched

    def _next_batch(self, out: SchedulerOutput, batch: DecodeBatch) -> DecodeBatch | None:
        """The same rows one token further on, if every row surely continues and its slot is already held."""
        bs = self.block_size
        slots = []
        for s, blocks, n in zip(out.scheduled, batch.block_ids, batch.seq_lens):
            req = s.request
            # This step's token makes n + 1 tokens: the request ends there at max_tokens or max_model_len.
            if len(req.output_token_ids) + 1 >= req.sampling_params.max_tokens or n + 1 >= self.max_model_len:
                return None  # this step is its last
            if n // bs >= len(blocks):
                return None  # the next token opens a block the scheduler has not allocated yet
            slots.append(blocks[n // bs] * bs + n % bs)
        return DecodeBatch(batch.token_ids, [p + 1 for p in batch.positions], batch.mrope, slots,
                           [n + 1 for n in batch.seq_lens], batch.block_ids, batch.sample_rows,
                           batch.sample_request_ids)
