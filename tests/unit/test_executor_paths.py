"""StepExecutor.plan, the one place a step's execution path is chosen: lookahead, decode graph, step graph or
eager, with stand-in graphs (which path, not what the graphs compute: the engine tests cover that)."""

from __future__ import annotations

import torch

from flashvlm.attention.reference import ReferenceBackend
from flashvlm.engine.sched_output import ScheduledRequest, SchedulerOutput
from flashvlm.request import Request, SamplingParams
from flashvlm.runner.executor import ExecutionPath, StepExecutor
from flashvlm.runner.inputs import PositionStore

BLOCK = 4
PROMPT = 5


class _DecodeGraphs:
    sizes = (1, 2, 4)

    def padded_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)


class _Pipeline:
    def __init__(self) -> None:
        self.drops = 0

    def drop(self) -> None:
        self.drops += 1


class _StepGraphs:
    def bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int] | None:
        return (16, 4) if num_tokens <= 16 and num_seqs <= 4 else None


def _executor(graphs: bool = True) -> tuple[StepExecutor, _Pipeline]:
    ex = StepExecutor(model=None, backend=ReferenceBackend(), block_size=BLOCK, dtype=torch.float32,
                      device=torch.device("cpu"))
    pipeline = _Pipeline()
    if graphs:
        ex.decode_graphs, ex.pipeline, ex.step_graphs = _DecodeGraphs(), pipeline, _StepGraphs()
    return ex, pipeline


def _step(num_decode: int, prefill_tokens: int = 0, temperature: float = 0.0,
          image: bool = False) -> tuple[SchedulerOutput, PositionStore]:
    """num_decode requests decoding their second generated token, then one prefill of prefill_tokens tokens."""
    out, positions = SchedulerOutput(), PositionStore()
    for i in range(num_decode + (prefill_tokens > 0)):
        decoding = i < num_decode
        prompt = list(range(PROMPT if decoding else prefill_tokens))
        req = Request(f"r{i}", prompt, SamplingParams(temperature=temperature, max_tokens=8))
        if decoding:
            req.output_token_ids = [7]
        start, n = (PROMPT, 1) if decoding else (0, prefill_tokens)
        blocks = list(range(1 + 8 * i, 1 + 8 * i + (start + n + BLOCK - 1) // BLOCK))
        out.scheduled.append(ScheduledRequest(req, n, blocks, start, samples=True))
        positions.put(req.request_id, torch.arange(len(prompt)), 0)
    if image:
        out.encoder_inputs = {"r0": [0]}
    return out, positions


def test_greedy_decode_in_the_ladder_takes_the_lookahead() -> None:
    ex, pipeline = _executor()
    plan = ex.plan(*_step(2))
    assert plan.path is ExecutionPath.LOOKAHEAD and plan.inputs is None and pipeline.drops == 0
    assert plan.sample_request_ids == ["r0", "r1"]


def test_decode_graph_without_the_lookahead_drops_it() -> None:
    for kwargs, allow in (({"temperature": 0.8}, True), ({}, False)):
        ex, pipeline = _executor()
        plan = ex.plan(*_step(3, **kwargs), allow_lookahead=allow)
        assert plan.path is ExecutionPath.DECODE_GRAPH and plan.batch.num_seqs == 3 and plan.inputs is None
        assert pipeline.drops == 1


def test_steps_outside_the_decode_ladder_take_a_step_graph_or_run_eagerly() -> None:
    ex, pipeline = _executor()
    assert ex.plan(*_step(1, prefill_tokens=10)).path is ExecutionPath.STEP_GRAPH  # mixed, in a bucket
    assert ex.plan(*_step(0, prefill_tokens=30)).path is ExecutionPath.EAGER  # larger than every bucket
    plan = ex.plan(*_step(8))  # decode beyond the ladder and the buckets' sequences
    assert plan.path is ExecutionPath.EAGER and plan.inputs.attn_step.num_seqs == 8
    plan = ex.plan(*_step(2, image=True))  # a step that encodes images never replays a decode graph
    assert plan.path is ExecutionPath.STEP_GRAPH and plan.batch is not None
    assert plan.inputs.attn_step.max_query_len == 1 and pipeline.drops == 4


def test_without_graphs_every_step_is_eager() -> None:
    ex, _ = _executor(graphs=False)
    for step in (_step(2), _step(1, prefill_tokens=10), _step(0, prefill_tokens=30)):
        plan = ex.plan(*step)
        assert plan.path is ExecutionPath.EAGER
        assert torch.equal(plan.inputs.attn_step.seq_lens,
                           torch.tensor([s.end for s in step[0].scheduled], dtype=torch.int32))


def test_a_row_asking_for_logprobs_takes_the_decode_graph_not_the_lookahead() -> None:
    # The lookahead reads back only the graph's argmax; the decode graph's logits go through the sampler, which
    # also gives the asking rows' log-probabilities.
    ex, pipeline = _executor()
    out, positions = _step(2)
    out.scheduled[1].request.sampling_params.logprobs = 2
    plan = ex.plan(out, positions)
    assert plan.path is ExecutionPath.DECODE_GRAPH and plan.batch.num_seqs == 2 and pipeline.drops == 1


def test_greedy_rows_with_a_logits_processor_keep_the_lookahead() -> None:
    # A structured-output mask, the min_tokens ban and a repetition penalty are applied to the graph's logits when
    # the pipeline reaches the step (runner/lookahead.py); only sampling and logprobs leave the lookahead.
    from flashvlm.structured.params import StructuredOutputsParams

    ex, pipeline = _executor()
    out, positions = _step(3)
    params = [s.request.sampling_params for s in out.scheduled]
    params[0].structured_outputs = StructuredOutputsParams(regex="[a-z]+")
    params[1].min_tokens = 4
    params[2].repetition_penalty = 1.3
    plan = ex.plan(out, positions)
    assert plan.path is ExecutionPath.LOOKAHEAD and plan.batch.num_seqs == 3 and pipeline.drops == 0
    out, positions = _step(2, temperature=0.7)
    assert ex.plan(out, positions).path is ExecutionPath.DECODE_GRAPH and pipeline.drops == 1


def test_tensor_parallel_ranks_keep_constrained_rows_off_the_lookahead() -> None:
    # Each rank feeds its own picks to the step launched ahead, and only rank 0 holds the grammar matchers: the
    # workers would feed unmasked tokens. min_tokens and repetition penalties are mirrored to every rank.
    from flashvlm.runner.lookahead import ranks_agree_ahead
    from flashvlm.structured.params import StructuredOutputsParams

    out, _ = _step(2)
    out.scheduled[0].request.sampling_params.min_tokens = 4
    assert ranks_agree_ahead(out, 1) and ranks_agree_ahead(out, 2)
    out.scheduled[1].request.sampling_params.structured_outputs = StructuredOutputsParams(regex="[a-z]+")
    assert ranks_agree_ahead(out, 1) and not ranks_agree_ahead(out, 2)
