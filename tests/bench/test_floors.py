"""The floor of a whole offline run (bench/floors.py): decode step count, the parts of its sum, and the figures
the benchmark notes give for the Qwen2-VL-7B config, from the real-size model built on the meta device."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from flashvlm.bench.floors import (
    ModelCost,
    RequestWork,
    min_decode_steps,
    model_cost,
    prefill_flops,
    run_floor,
    run_work,
    vision_flops,
)
from flashvlm.bench.model_configs import QWEN2_5_VL_7B, QWEN2_VL_7B
from flashvlm.bench.records import BenchRequest, RequestRecord

TINY = ModelCost(lm_weight_bytes=1000, lm_matmul_params=100, lm_head_params=10, num_layers=2, num_heads=2,
                 head_dim=4, kv_bytes_per_token=8, vit_matmul_params=50, vit_depth=1, vit_width=4)


def _meta_cost(tmp_path_factory, hf_config: dict) -> ModelCost:
    from transformers import AutoConfig

    from flashvlm.models.registry import resolve_family

    path = tmp_path_factory.mktemp("qwen7b")
    (path / "config.json").write_text(json.dumps(hf_config))
    config = AutoConfig.from_pretrained(path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):  # shapes only: no 8B parameters are allocated
            model = resolve_family(config.architectures).model_class()(config)
    finally:
        torch.set_default_dtype(previous)
    return model_cost(model)


@pytest.fixture(scope="module")
def qwen7b_cost(tmp_path_factory) -> ModelCost:
    return _meta_cost(tmp_path_factory, QWEN2_VL_7B)


def test_windowed_vit_layers_count_their_windows_only(tmp_path_factory, qwen7b_cost: ModelCost) -> None:
    """Qwen2.5-VL-7B: 4 of 32 layers attend over the whole image, 28 within windows of 8 x 8 patches."""
    cost = _meta_cost(tmp_path_factory, QWEN2_5_VL_7B)
    assert (cost.vit_full_layers, cost.vit_window_patches, cost.vit_depth) == (4, 64, 32)
    assert (qwen7b_cost.vit_full_layers, qwen7b_cost.vit_window_patches) == (-1, 0)  # Qwen2-VL: all full
    patches = 9216  # 1344x1344
    attention = 4.0 * 1280 * (4 * patches**2 + 28 * patches * 64)
    assert vision_flops(cost, patches) == pytest.approx(2.0 * patches * cost.vit_matmul_params + attention)
    assert vision_flops(qwen7b_cost, patches) == pytest.approx(
        2.0 * patches * qwen7b_cost.vit_matmul_params + 4.0 * 1280 * 32 * patches**2)
    # An image smaller than one window: every layer sees the whole image.
    assert vision_flops(cost, 16) == pytest.approx(2.0 * 16 * cost.vit_matmul_params + 4.0 * 1280 * 32 * 16**2)


def _greedy_steps(decode_tokens: list[int], max_num_seqs: int) -> int:
    """Simulate steps that each decode the max_num_seqs requests with the most tokens left (optimal for unit
    tasks in chains: Hu's highest-level-first)."""
    left = sorted(decode_tokens, reverse=True)
    steps = 0
    while left and left[0] > 0:
        left[:max_num_seqs] = [n - 1 for n in left[:max_num_seqs]]
        left = sorted((n for n in left if n > 0), reverse=True)
        steps += 1
    return steps


def test_min_decode_steps_matches_a_simulated_schedule() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(0, 30, size=int(rng.integers(1, 12))).tolist()
        batch = int(rng.integers(1, 6))
        assert min_decode_steps(tokens, batch) == _greedy_steps(tokens, batch), (tokens, batch)
    assert min_decode_steps([127] * 512, 256) == 254
    assert min_decode_steps([100, 1, 1], 2) == 100  # the longest request bounds it, not the batch
    with pytest.raises(ValueError, match="max_num_seqs"):
        min_decode_steps([1], 0)


def test_run_floor_adds_compute_and_decode_bytes() -> None:
    work = [RequestWork(prompt_tokens=10, output_tokens=4, image_patches=(16,)),
            RequestWork(prompt_tokens=6, output_tokens=3)]
    f = run_floor(TINY, work, max_num_seqs=1, bandwidth=100.0, peak_flops=1000.0)
    assert f.prefill_flops == pytest.approx(prefill_flops(TINY, 10) + prefill_flops(TINY, 6))
    assert f.vision_flops == pytest.approx(vision_flops(TINY, 16))
    # Decode tokens: 3 at contexts 11, 12, 13 and 2 at 7, 8 (each attends to the prompt and what came after).
    keys = 11 + 12 + 13 + 7 + 8
    assert f.decode_flops == pytest.approx(5 * 2 * 110 + 4 * 2 * 2 * 4 * keys)
    assert f.decode_steps == 5  # one sequence a step
    assert (f.decode_weight_bytes, f.decode_kv_bytes) == (5 * 1000, 8 * keys)
    assert f.compute_s == pytest.approx((f.prefill_flops + f.vision_flops + f.decode_flops) / 1000.0)
    assert f.memory_s == pytest.approx((5 * 1000 + 8 * keys) / 100.0)
    assert f.floor_s == pytest.approx(f.compute_s + f.memory_s)
    assert f.roofline_s == max(f.compute_s, f.memory_s)
    assert f.floor_output_throughput == pytest.approx(7 / f.floor_s)
    # A batch shares each weight read: two sequences a step need 3 steps, not 5.
    assert run_floor(TINY, work, max_num_seqs=2).decode_weight_bytes == 3 * 1000
    achieved = f.achieved({"output_throughput": f.floor_output_throughput / 4})
    assert achieved["achieved_throughput_fraction"] == pytest.approx(0.25)
    assert f.achieved({"output_throughput": None})["achieved_throughput_fraction"] is None


def test_run_work_charges_each_image_once_and_skips_failures() -> None:
    requests = [BenchRequest("a", "", [None], 4, image_keys=["x"]), BenchRequest("b", "", [None, None], 4,
                                                                                    image_keys=["x", "y"]),
                BenchRequest("c", "", [None], 4, image_keys=["z"])]
    records = [RequestRecord("a", prompt_tokens=30, output_tokens=4, image_patches=[64]),
               RequestRecord("b", prompt_tokens=50, output_tokens=4, image_patches=[64, 100]),
               RequestRecord("c", success=False, image_patches=[9])]
    assert run_work(records, requests) == [RequestWork(30, 4, (64,)), RequestWork(50, 4, (100,))]


@pytest.mark.parametrize(("requests", "image_tokens", "expected"), [(512, 972, 3850), (256, 2691, 1230)])
def test_qwen2_vl_7b_workload_floors_match_the_benchmark_notes(qwen7b_cost: ModelCost, requests: int,
                                                               image_tokens: int, expected: float) -> None:
    """The offline floors the throughput notes give for one H200 (790 TFLOP/s, 4.2 TB/s), 64 text tokens and
    128 output tokens a request, 256 sequences a batch: ~3,850 output tok/s at 1008x756 (972 image tokens, 3,888
    patches) and ~1,230 at 1920x1080 (2,691 tokens, 10,764 patches). We get 3,868 (+0.5%) and 1,294 (+5%);
    the notes do not give their prompt length or patch count at 1920x1080, where the ViT's full attention over
    10,764 patches is a quarter of the FLOPs, so a small difference there moves the floor most."""
    work = [RequestWork(image_tokens + 64, 128, (4 * image_tokens,))] * requests
    f = run_floor(qwen7b_cost, work, max_num_seqs=256, bandwidth=4.2e12, peak_flops=790e12)
    assert f.floor_output_throughput == pytest.approx(expected, rel=0.15)
    assert f.decode_steps == math.ceil(requests * 127 / 256)
    assert f.decode_weight_bytes == f.decode_steps * qwen7b_cost.lm_weight_bytes
    # Prefill and the ViT are most of the floor: the workload is compute-bound.
    assert f.compute_s > 5 * f.memory_s


@pytest.mark.parametrize(("method", "expected_gb"), [("fp8", 7.6), ("int4", 4.4)])
def test_quantized_weight_bytes(method: str, expected_gb: float, tmp_path) -> None:
    """A quantized model's decode reads its weights as stored: FP8 linears with a bf16 head are 7.6 GB a token on
    the Qwen2-VL-7B config, INT4 (groups of 128, bf16 scales) about 4.4 GB; products keep their parameter count."""
    from transformers import AutoConfig

    from flashvlm.models.registry import resolve_family
    from flashvlm.quant.apply import float_targets, replace_module
    from flashvlm.quant.registry import get_method

    (tmp_path / "config.json").write_text(json.dumps(QWEN2_VL_7B))
    config = AutoConfig.from_pretrained(tmp_path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = resolve_family(config.architectures).model_class()(config)
    finally:
        torch.set_default_dtype(previous)
    float_cost = model_cost(model)
    quant = get_method(method)
    for name in float_targets(model, quantize_vision=False):
        replace_module(model, name, quant.empty_layer(model.get_submodule(name), quant.default_scheme()))
    cost = model_cost(model)
    assert cost.lm_matmul_params == float_cost.lm_matmul_params
    assert cost.lm_weight_bytes / 1e9 == pytest.approx(expected_gb, rel=0.03)
    assert cost.lm_weight_bytes < float_cost.lm_weight_bytes


@pytest.mark.slow
def test_fuyu_8b_benchmark_folder_builds_the_real_size_model(tmp_path) -> None:
    """`--benchmark-model fuyu-8b`: the folder passes the family's load checks, and the model built from it on
    the meta device has Fuyu-8B's 9.41B parameters; its only vision work is the 2700 -> 4096 patch projection."""
    from flashvlm.bench.model_configs import write_benchmark_model
    from flashvlm.config import ModelConfig
    from flashvlm.models.loader import read_checkpoint

    checkpoint = read_checkpoint(ModelConfig(model=str(write_benchmark_model("fuyu-8b", tmp_path))))
    with torch.device("meta"):
        model = checkpoint.family.model_class()(checkpoint.hf_config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 9.41
    cost = model_cost(model)
    assert cost.vit_matmul_params == 2700 * 4096 and cost.vit_depth == 0
    assert (cost.num_layers, cost.num_heads, cost.head_dim) == (36, 64, 64)
