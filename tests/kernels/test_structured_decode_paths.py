"""Structured outputs through the greedy decode lookahead (float32, Triton attention).

A decode batch with a greedy constrained row stays on the lookahead: the step keeps the graph's logits and its
tokens are picked (grammar mask, then argmax) when the engine reaches it; rows with a min_tokens ban or a
repetition penalty go the same way beside it. Every row's tokens stay the eager path's. On CPU the decode graphs'
bodies run eagerly on their buffers (Triton interpreter); on CUDA the engine's captured graphs and its own
lookahead are used.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("triton")
pytest.importorskip("xgrammar")

from flashvlm import LLM, SamplingParams  # noqa: E402
from flashvlm.structured.params import StructuredOutputsParams  # noqa: E402
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl  # noqa: E402
from tests.kernels.test_logprobs_decode_paths import IMG, OPTS, generate_beside_lookahead  # noqa: E402

pytestmark = pytest.mark.slow  # engine runs through the Triton interpreter on CPU


def test_constrained_rows_take_the_lookahead_with_the_eager_paths_tokens(tmp_path) -> None:
    path = str(build_qwen2_vl(tmp_path / "m", seed=9))
    rng = np.random.default_rng(4)
    prompts = [{"prompt": IMG + "One.", "images": [rng.integers(0, 256, (56, 56, 3), np.uint8)]},
               {"prompt": "Two, text only, and longer."}, {"prompt": "Three."}]
    # Long enough to outlast the prefill steps: the first decode step of all three is then launched ahead.
    constrained = SamplingParams(temperature=0.0, max_tokens=30,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]{24}"))
    banned = SamplingParams(temperature=0.0, max_tokens=14, min_tokens=10, repetition_penalty=1.5)
    params = [constrained, banned, constrained]
    expected = LLM(path, enforce_eager=True, **OPTS).generate(prompts, params)

    outs, launched, pipeline = generate_beside_lookahead(path, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert re.fullmatch("[a-z]{24}", outs[0].text) and re.fullmatch("[a-z]{24}", outs[2].text)
    # Steps holding the constrained rows were launched ahead, and the lookahead kept them.
    assert any({outs[0].request_id, outs[2].request_id} <= set(ids) for ids in launched)
    assert pipeline.num_lookaheads > pipeline.num_dropped


def test_the_fused_masked_greedy_kernel_gives_the_eager_paths_tokens(tmp_path, monkeypatch) -> None:
    # Lookahead steps whose rows are greedy without a repetition penalty pick their tokens with
    # kernels/masked_greedy.py on CUDA; here it is forced onto the CPU tensors (Triton's interpreter).
    import flashvlm.kernels.masked_greedy as masked_greedy
    import flashvlm.runner.model_runner as model_runner

    path = str(build_qwen2_vl(tmp_path / "m", seed=9))
    prompts = [{"prompt": "One, text only."}, {"prompt": "Two, text only, and longer."}]
    constrained = SamplingParams(temperature=0.0, max_tokens=20,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]{16}"))
    banned = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)
    expected = LLM(path, enforce_eager=True, **OPTS).generate(prompts, [constrained, banned])
    calls = []
    kernel = masked_greedy.masked_greedy_triton
    monkeypatch.setattr(masked_greedy, "masked_greedy_triton", lambda *a: calls.append(1) or kernel(*a))
    monkeypatch.setattr(model_runner, "use_triton", lambda x, enabled=None: True)
    outs, launched, pipeline = generate_beside_lookahead(path, prompts, [constrained, banned])
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert calls and pipeline.num_lookaheads > 0 and len(outs[1].token_ids) == 12
