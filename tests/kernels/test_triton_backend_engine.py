"""The whole engine on the Triton attention backend gives the reference backend's greedy tokens (float32).

On CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py); on a GPU machine, compiled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from flashvlm import LLM, SamplingParams  # noqa: E402
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl  # noqa: E402

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def test_triton_backend_matches_reference(tmp_path) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(build_qwen2_vl(tmp_path / "m", seed=13))
    rng = np.random.default_rng(1)
    prompts = [{"prompt": IMG + "Describe the picture.", "images": [rng.integers(0, 256, (56, 84, 3), np.uint8)]},
               {"prompt": "A text-only question of a different length?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("reference", "triton"):
        # A small token budget forces chunked prefill: chunks after a cached prefix, mixed with decode tokens.
        llm = LLM(path, device=device, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=24,
                  attention_backend=backend, kernel_backend="torch", enforce_eager=True)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["reference"]
