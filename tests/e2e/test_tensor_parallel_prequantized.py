"""Tensor parallelism on pre-quantized checkpoints (CPU, 2 gloo ranks, float32 activations): each format gives the
greedy tokens of tensor_parallel_size 1, each rank holds only its slices of the stored tensors, and a split that
does not fall on the checkpoint's groups or blocks is refused by name."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.config import ConfigError
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.prequant_shard import quantized_row_parallel
from flashvlm.distributed.quant_shard import QuantizedRowParallel
from flashvlm.layers.linear import Linear
from flashvlm.quant.registry import get_method
from flashvlm.testing.quantized_fp8 import (
    write_compressed_tensors_fp8,
    write_compressed_tensors_fp8_blocks,
    write_transformers_fp8,
)
from flashvlm.testing.quantized_int4 import write_int4_checkpoint
from flashvlm.testing.quantized_int8 import build_int8_qwen2_vl
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

QWEN = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTIONS = {"device": "cpu", "dtype": "float32", "kv_cache_tokens": 2048, "distributed_timeout_s": 60}


def _prompts() -> list:
    rng = np.random.default_rng(0)
    return [{"prompt": QWEN + "describe the picture", "images": [rng.integers(0, 256, (112, 56, 3), dtype=np.uint8)]},
            "a prompt without an image, long enough to differ"]


def _tokens(path: Path, size: int, **options) -> list[list[int]]:
    with LLM(str(path), tensor_parallel_size=size, **OPTIONS, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def _int8(static: bool) -> Callable[[Path, Path], Path]:
    return lambda base, dst: build_int8_qwen2_vl(dst, static_activations=static)


# The tiny Qwen2-VL is 64 wide with 4 heads of 16 (2 KV heads) and an MLP 128 wide: each rank's o_proj reads 32
# inputs and its down_proj 64, so groups and blocks of 32 columns split whole; 32-row blocks hold both ranks' K
# and V rows (16 each) in one block row.
FORMATS: dict[str, Callable[[Path, Path], Path]] = {
    "fp8-channel-dynamic": write_compressed_tensors_fp8,
    "fp8-tensor-static": functools.partial(write_compressed_tensors_fp8, weight="tensor", activation="static"),
    "fp8-weight-only": functools.partial(write_compressed_tensors_fp8, activation=None),
    "fp8-transformers-blocks": functools.partial(write_transformers_fp8, block=(32, 32)),
    "fp8-compressed-tensors-blocks": functools.partial(write_compressed_tensors_fp8_blocks, block=(32, 32)),
    "int8-dynamic": _int8(False),
    "int8-static": _int8(True),
    "int4-groups": functools.partial(write_int4_checkpoint, group_size=32),
    "int4-asymmetric-groups": functools.partial(write_int4_checkpoint, group_size=32, symmetric=False),
    "int4-asymmetric-channel": functools.partial(write_int4_checkpoint, group_size=None, symmetric=False),
}


# The default run keeps the dynamic FP8 path (each token's whole-row amax across ranks) here and INT4's groups split
# on the rows in test_each_rank_holds_its_slices_of_the_quantized_tensors, on the engine whose slices it reads; each
# other format is one more pair of engines (5-10 s) and runs with the slow tests.
FAST_FORMATS = ("fp8-channel-dynamic",)


@pytest.mark.parametrize("fmt", [f if f in FAST_FORMATS else pytest.param(f, marks=pytest.mark.slow) for f in FORMATS])
def test_prequantized_checkpoint_matches_one_rank(tmp_path, fmt):
    quantized = FORMATS[fmt](build_qwen2_vl(tmp_path / "base"), tmp_path / "quantized")
    single = _tokens(quantized, 1)
    assert _tokens(quantized, 2) == single


@pytest.mark.slow
def test_prequantized_checkpoint_with_a_sharded_tower_matches_one_rank(tmp_path):
    quantized = write_compressed_tensors_fp8(build_qwen2_vl(tmp_path / "base"), tmp_path / "quantized")
    assert _tokens(quantized, 2, mm_encoder_tp_mode="weights") == _tokens(quantized, 1)


def test_each_rank_holds_its_slices_of_the_quantized_tensors(tmp_path):
    """Rank 0's slices of an INT4 checkpoint in groups of 32, then the greedy tokens of one rank (the int4-groups
    case of test_prequantized_checkpoint_matches_one_rank, which runs with the slow tests)."""
    quantized = FORMATS["int4-groups"](build_qwen2_vl(tmp_path / "base"), tmp_path / "int4")
    single = _tokens(quantized, 1)
    with LLM(str(quantized), tensor_parallel_size=2, **OPTIONS) as llm:
        layer = llm.engine.model.language_model.layers[0]
        qkv, o = layer.self_attn.qkv_proj, layer.self_attn.o_proj
        assert (qkv.in_features, qkv.out_sizes) == (64, [32, 16, 16])  # this rank's 2 heads and 1 KV head
        assert tuple(qkv.scales.shape) == (2, 64)  # (groups of 32, local rows)
        assert isinstance(o, QuantizedRowParallel) and o.pad == 0
        assert (o.inner.in_features, o.inner.out_features, tuple(o.inner.scales.shape)) == (32, 64, (1, 64))
        down = layer.mlp.down_proj
        assert (down.inner.in_features, tuple(down.inner.scales.shape)) == (64, (2, 64))
        assert [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)] == single


@pytest.mark.parametrize(("write", "what"), [
    (functools.partial(write_int4_checkpoint, group_size=128), "groups of 128"),
    pytest.param(write_transformers_fp8, "weight blocks' columns of 128", marks=pytest.mark.slow),
])
def test_splits_off_the_groups_or_blocks_are_refused(tmp_path, write, what):
    quantized = write(build_qwen2_vl(tmp_path / "base"), tmp_path / "quantized")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2: \S+ holds \d+ of its \d+ "
                                          rf"inputs per rank, not a whole number of its {what}"):
        _tokens(quantized, 2)


class _OtherRank(TPGroup):
    """Rank 0 of two whose other rank's inputs are `other`: all_max sees both; all_reduce leaves the sum to the
    test."""

    def __init__(self, other: torch.Tensor) -> None:
        super().__init__()
        self.other = other

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x, self.other.abs().amax(dim=-1, keepdim=True), out=x)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_dynamic_activations_round_with_the_whole_rows_amax(method):
    """A row-parallel slice of a loaded quantized layer rounds each token with its amax over every rank's inputs:
    the ranks' partial products add up to the one-rank product (up to the float sum's order)."""
    torch.manual_seed(0)
    full = Linear(32, 8, bias=True)
    with torch.no_grad():
        full.weight.normal_()
        full.bias.normal_()
    m = get_method(method)
    whole = m.quantize(full, m.default_scheme())
    x = torch.randn(5, 32)
    x[:, 20] = 30.0  # rank 1's inputs hold every token's amax: rank 0 must take it from the maximum
    halves = []
    for cols, other in ((slice(0, 16), x[:, 16:]), (slice(16, 32), x[:, :16])):
        local = m.empty_layer(Linear(16, 8, bias=True), m.default_scheme())
        local.weight.data.copy_(whole.weight.data[:, cols])
        local.weight_scale.data.copy_(whole.weight_scale.data)
        local.bias.data.copy_(whole.bias.data)
        part = quantized_row_parallel(local, _OtherRank(other), 0, 16, "o_proj")
        assert part.pad == 16 and part.inner.bias is None
        halves.append(part(x[:, cols]))  # a group of one: each half plus the bias, no sum
    torch.testing.assert_close(halves[0] + halves[1] - full.bias, whole(x), rtol=1e-5, atol=1e-5)


def test_what_is_not_split_as_it_loads_is_refused():
    from types import SimpleNamespace

    from flashvlm.distributed.prequant_shard import check_vision_float
    from flashvlm.distributed.sharded_load import check_prequantized_split

    group = TPGroup(0, 2)
    with pytest.raises(ConfigError, match="pre-quantized persimmon checkpoint with tensor_parallel_size 2"):
        check_prequantized_split(SimpleNamespace(model_type="persimmon"), group, "auto")
    qwen = SimpleNamespace(model_type="qwen2_vl", num_key_value_heads=2)
    with pytest.raises(ConfigError, match="random weights"):
        check_prequantized_split(qwen, group, "dummy")
    check_prequantized_split(qwen, group, "auto")
    model = torch.nn.Module()
    model.visual = torch.nn.Module()
    model.visual.proj = get_method("int8").empty_layer(Linear(16, 8, bias=False), get_method("int8").default_scheme())
    with pytest.raises(ConfigError, match="visual.proj is stored quantized: mm_encoder_tp_mode 'weights'"):
        check_vision_float(model)
