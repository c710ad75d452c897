"""Structured outputs on the decode-graph path, beside the greedy decode lookahead (float32, Triton attention).

A decode batch with a constrained row leaves the lookahead (whose argmax would ignore the mask) for the decode
graph and the sampler; once no row is constrained, the lookahead resumes. Every row's tokens stay the eager
path's. On CPU the decode graphs' bodies run eagerly on their buffers (Triton interpreter); on CUDA the engine's
captured graphs and its own lookahead are used.
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


def test_constrained_rows_take_the_decode_graph_and_the_others_keep_their_tokens(tmp_path) -> None:
    path = str(build_qwen2_vl(tmp_path / "m", seed=9))
    rng = np.random.default_rng(4)
    prompts = [{"prompt": IMG + "One.", "images": [rng.integers(0, 256, (56, 56, 3), np.uint8)]},
               {"prompt": "Two, text only, and longer."}, {"prompt": "Three."}]
    constrained = SamplingParams(temperature=0.0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex="[a-z]{4}"))
    plain = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    params = [constrained, plain, constrained]
    expected = LLM(path, enforce_eager=True, **OPTS).generate(prompts, params)

    outs, launched, pipeline = generate_beside_lookahead(path, prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert re.fullmatch("[a-z]{4}", outs[0].text) and re.fullmatch("[a-z]{4}", outs[2].text)
    constrained_ids = {outs[0].request_id, outs[2].request_id}
    assert launched and all(not constrained_ids & set(ids) for ids in launched) and pipeline.num_lookaheads > 0
