"""Log-probabilities on the decode-graph path, beside the greedy decode lookahead (float32, Triton attention).

A decode batch with a row asking for logprobs leaves the lookahead (which reads back only the graph's argmax) for
the decode graph and the sampler; once no row asks, the lookahead resumes. Tokens stay the eager path's, and the
values are the eager path's. On CPU the decode graphs' bodies run eagerly on their buffers (Triton interpreter);
on CUDA the engine's captured graphs and its own lookahead are used.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from flashvlm import LLM, SamplingParams  # noqa: E402
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl  # noqa: E402

pytestmark = pytest.mark.slow  # engine runs through the Triton interpreter on CPU

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
OPTS = dict(device="cuda" if torch.cuda.is_available() else "cpu", dtype="float32", kv_cache_tokens=2048,
            max_num_seqs=4, attention_backend="triton", kernel_backend="torch", prefill_graph_max_tokens=0,
            max_model_len=64, block_size=16)


def _graphs_and_lookahead_on_cpu(llm: LLM) -> None:
    """What the engine builds on CUDA (decode graphs, the lookahead on them), built on CPU too."""
    from flashvlm.runner.cuda_graph import DecodeGraphs
    from flashvlm.runner.lookahead import GreedyDecodePipeline

    runner, engine = llm.engine.runner, llm.engine
    if runner.device.type != "cpu":
        return
    runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.kv_caches, engine.config.scheduler.max_num_seqs,
                                 engine.max_model_len, runner.block_size, runner.device)
    runner.pipeline = GreedyDecodePipeline(runner.graphs, runner.block_size, engine.max_model_len)
    engine.limits = dataclasses.replace(engine.limits, lookahead_slots=1)
    engine.scheduler._lookahead_slots = 1


def generate_beside_lookahead(path: str, prompts: list, params: list) -> tuple[list, list[list[str]], Any]:
    """Outputs of an engine with decode graphs and the lookahead, the request ids of every step the lookahead
    launched, in order, and its pipeline."""
    llm = LLM(path, **OPTS)
    _graphs_and_lookahead_on_cpu(llm)
    pipeline = llm.engine.runner.pipeline
    launched: list[list[str]] = []
    launch = pipeline._launch

    def recording_launch(batch, input_ids, **kwargs):
        launched.append(list(batch.sample_request_ids))
        return launch(batch, input_ids, **kwargs)

    pipeline._launch = recording_launch
    return llm.generate(prompts, params), launched, pipeline


def test_logprobs_rows_take_the_decode_graph_and_the_others_keep_their_tokens(tmp_path) -> None:
    path = str(build_qwen2_vl(tmp_path / "m", seed=9))
    rng = np.random.default_rng(4)
    prompts = [{"prompt": IMG + "One.", "images": [rng.integers(0, 256, (56, 56, 3), np.uint8)]},
               {"prompt": "Two, text only, and longer."}, {"prompt": "Three."}]
    asking = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=4)
    plain = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    params = [asking, plain, asking]
    eager = LLM(path, enforce_eager=True, **OPTS)
    expected = eager.generate(prompts, params)
    assert [o.token_ids for o in eager.generate(prompts, [dataclasses.replace(p, logprobs=None) for p in params])] \
        == [o.token_ids for o in expected]

    outs, launched, pipeline = generate_beside_lookahead(path, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    asking_ids = {outs[0].request_id, outs[2].request_id}
    # The plain request went through the lookahead once the asking ones were done, never beside them.
    assert launched and all(not asking_ids & set(ids) for ids in launched) and pipeline.num_lookaheads > 0
    for got, want in zip(outs, expected):
        if want.logprobs is None:
            assert got.logprobs is None
            continue
        assert len(got.logprobs) == len(want.logprobs) == len(got.token_ids)
        for g, w in zip(got.logprobs, want.logprobs):
            assert g.token_id == w.token_id == g.top[0][0]
            assert abs(g.logprob - w.logprob) <= 1e-4
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert np.allclose([v for _, v in g.top], [v for _, v in w.top], atol=1e-4, rtol=0)
