"""The decode fast path (DecodeBatch -> device tensors) builds exactly what the general path builds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.runner import inputs as inputs_mod
from flashvlm.testing.tiny_checkpoints import build_llava, build_qwen2_vl


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])  # M-RoPE (3, N) positions and 1-D positions
def test_decode_fast_path_equals_general_path(tmp_path, family) -> None:
    build = build_qwen2_vl if family == "qwen2_vl" else build_llava
    llm = LLM(str(build(tmp_path / "m", seed=3)), device="cpu", kv_cache_tokens=4096, max_num_batched_tokens=64)
    compared = []
    make_batch = inputs_mod.decode_batch

    def checking_batch(out, positions, block_size):
        batch = make_batch(out, positions, block_size)
        if batch is not None:
            fast = inputs_mod.decode_step_inputs(batch, block_size, torch.device("cpu"))
            general = inputs_mod.general_step_inputs(out, positions, block_size, torch.device("cpu"))
            for name in ("input_ids", "positions", "sample_rows"):
                assert torch.equal(getattr(fast, name), getattr(general, name)), name
            assert fast.sample_request_ids == general.sample_request_ids
            fm, gm = fast.attn_step, general.attn_step
            for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
                assert torch.equal(getattr(fm, name), getattr(gm, name)), name
            assert (fm.query_start_loc_host, fm.seq_lens_host, fm.max_query_len, fm.max_seq_len) == (
                gm.query_start_loc_host, gm.seq_lens_host, gm.max_query_len, gm.max_seq_len)
            compared.append(batch.num_seqs)
        return batch

    import flashvlm.runner.executor as runner_mod

    runner_mod.decode_batch = checking_batch
    try:
        rng = np.random.default_rng(0)
        image = "<|vision_start|><|image_pad|><|vision_end|>" if family == "qwen2_vl" else "<image>"
        prompts = [{"prompt": image + "Describe it. " * (k + 1), "images": [rng.integers(0, 256, (56, 56, 3),
                                                                                          np.uint8)]}
                   for k in range(3)] + [{"prompt": "text only"}]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    finally:
        runner_mod.decode_batch = make_batch
    assert compared and max(compared) >= 2  # batched decode steps were checked
