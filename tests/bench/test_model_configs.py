"""The benchmark's real-size model folders build the same model as transformers (parameter for parameter, on the
meta device), and the transformers baseline's inputs for a Qwen3-VL image prompt give transformers our tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.bench.model_configs import CONFIGS, write_benchmark_model
from flashvlm.config import ModelConfig
from flashvlm.models.loader import read_checkpoint
from flashvlm.testing.tiny_checkpoints import build_qwen3_vl


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_benchmark_model_matches_transformers_shapes(name: str, tmp_path) -> None:
    checkpoint = read_checkpoint(ModelConfig(model=str(write_benchmark_model(name, tmp_path))))
    with torch.device("meta"):
        ours = checkpoint.family.model_class()(checkpoint.hf_config)
        theirs = checkpoint.family.baseline_model_class()._from_config(checkpoint.hf_config)
    assert checkpoint.family.architecture == CONFIGS[name][0]["architectures"][0]
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    processor = checkpoint.family.image_processor(checkpoint.preprocessor_config)
    if hasattr(checkpoint.hf_config, "vision_config"):
        assert processor.patch_size == checkpoint.hf_config.vision_config.patch_size
    else:  # Fuyu: no vision tower, the processor's patches go straight into the decoder
        assert processor.patch_hw == (checkpoint.hf_config.patch_size,) * 2


@torch.inference_mode()
def test_transformers_baseline_inputs_for_qwen3_vl(tmp_path) -> None:
    from flashvlm.bench.baselines.transformers_baseline import TransformersBaseline

    path = str(build_qwen3_vl(tmp_path, seed=11))
    baseline = TransformersBaseline(path, dtype="float32", device="cpu")
    image = np.random.default_rng(0).integers(0, 256, (90, 150, 3), dtype=np.uint8)
    prompts = [{"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is it?", "images": [image]},
               {"prompt": "Hello there, a longer text-only prompt."}]
    inputs = baseline._batch_inputs([baseline.processor.process(p) for p in prompts])  # left-padded, mixed
    assert "mm_token_type_ids" in inputs
    out = baseline.model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                                  pad_token_id=baseline.pad_id)
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=1024)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    width = inputs["input_ids"].shape[1]
    assert [o.token_ids for o in ours] == out[:, width:].tolist()
