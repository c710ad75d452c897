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


def test_fused_rotary_feeds_strided_queries_to_the_kernels(tmp_path, monkeypatch) -> None:
    """With the fused rotary kernel, q and k reach the attention kernels as strided views of the packed QKV
    output; the tokens must not change (float32, the rotary kernel forced on for CPU tensors too)."""
    import flashvlm.layers.rotary as rotary_mod
    from flashvlm.kernels import dispatch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(build_qwen2_vl(tmp_path / "m", seed=5))
    rng = np.random.default_rng(2)
    prompts = [{"prompt": IMG + "What is shown?", "images": [rng.integers(0, 256, (56, 56, 3), np.uint8)]},
               {"prompt": "Text only, a little longer than the other one."}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    calls = []

    def rotary_on_cpu_too(x, enabled=None, force=False):
        calls.append(enabled)
        return enabled is not False and (x.is_cuda or dispatch.interpreter_active())

    outs = {}
    for kernels in ("torch", "triton"):
        if kernels == "triton":
            monkeypatch.setattr(rotary_mod, "use_triton", rotary_on_cpu_too)
        llm = LLM(path, device=device, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=24,
                  attention_backend="triton", kernel_backend=kernels if device == "cuda" else "torch",
                  enforce_eager=True)
        if kernels == "triton" and device == "cpu":
            for layer in llm.engine.runner.model.modules():
                if hasattr(layer, "qkv_proj"):
                    layer.use_triton_kernels = True  # the rotary layers only; norms stay on torch
        outs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls and any(c is not False for c in calls), "the fused rotary path never ran"
    assert outs["triton"] == outs["torch"]
