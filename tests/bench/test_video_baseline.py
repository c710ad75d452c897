"""The benchmark's transformers baseline fed videos: in a left-padded batch of a clip decoded from a file, a clip
beside an image and a text-only prompt, its greedy tokens equal ours and its first-step logits are within 1e-4, in
float32 on each Qwen family's tiny checkpoint (pixel_values_videos, video_grid_thw, mm_token_type_ids, Qwen2.5-VL's
second_per_grid_ts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.bench.records import BenchRequest
from tests.e2e.test_video import IMAGE, VIDEO, _clip, _encode


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@torch.inference_mode()
def test_baseline_video_tokens_equal_ours(tmp_path, name: str) -> None:
    pytest.importorskip("av")
    from flashvlm.bench.baselines.transformers_baseline import TransformersBaseline
    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl, build_qwen3_vl

    path = str(build_qwen3_vl(tmp_path, seed=5) if name == "qwen3_vl"
               else build_qwen2_vl(tmp_path, qwen25=name == "qwen2_5_vl", seed=5))
    f = 32 if name == "qwen3_vl" else 28
    # A file at 2 fps sampled at 2 fps: one second a temporal patch, so Qwen2.5-VL's time step is not 0.
    clip = _encode(_clip(6, 2 * f, 2 * f, seed=1), fps=2)
    image = np.random.default_rng(0).integers(0, 256, (2 * f, 3 * f, 3), dtype=np.uint8)
    requests = [BenchRequest("a", f"{VIDEO}What happens?", [], 6, videos=[clip]),
                BenchRequest("b", f"{IMAGE}and{VIDEO}", [image], 6, videos=[_clip(4, 3 * f, 2 * f, seed=2)]),
                BenchRequest("c", "Hello there, a longer text-only prompt.", [], 6)]
    baseline = TransformersBaseline(path, dtype="float32", device="cpu")
    inputs = baseline._batch_inputs([baseline._process(r) for r in requests])
    assert inputs["video_grid_thw"].shape[0] == (5 if name == "qwen3_vl" else 2)  # Qwen3-VL: a row per patch
    assert ("second_per_grid_ts" in inputs) == (name == "qwen2_5_vl")
    if name == "qwen2_5_vl":
        assert inputs["second_per_grid_ts"][0].item() == 1.0
    out = baseline.model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                  pad_token_id=baseline.pad_id)
    first = baseline.model(**inputs).logits[:, -1]
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=4096)
    llm.engine.runner.record_logits = True
    ours = llm.generate([r.engine_prompt() for r in requests],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    width = inputs["input_ids"].shape[1]
    assert [o.outputs[0].token_ids for o in ours] == out[:, width:].tolist()
    for row, o in enumerate(ours):  # first-step logits: positions (time steps included) and pixels as ours
        assert (llm.engine.runner.recorded_logits[o.request_id][0] - first[row]).abs().max().item() <= 1e-4
