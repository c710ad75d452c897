"""The int8 W8A8 method (quant/int8.py): rounding float weights, the layer against an independent reference,
loading merged projections, and reading compressed-tensors' int-quantized configs (quant/compressed_int8.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from flashvlm.kernels import dispatch
from flashvlm.layers.linear import Linear, MergedLinear
from flashvlm.quant.base import QuantFormatError
from flashvlm.quant.int8 import Int8Linear, Int8Method, Int8Scheme
from flashvlm.testing.quantized_int8 import int8_quantization_config

METHOD = Int8Method()


def _float_layer(in_features: int, out_sizes: list[int], bias: bool, seed: int) -> MergedLinear:
    torch.manual_seed(seed)
    layer = MergedLinear(in_features, out_sizes, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.05)
        if bias:
            layer.bias.normal_()
    return layer


def _fake_quant_rows(x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token symmetric int8 quantize-dequantize, written out independently of the code under test."""
    x = x.double()
    s = x.abs().amax(dim=-1, keepdim=True) / 127 if scale is None else scale.double().reshape(1, 1)
    return torch.round(x / s).clamp(-127, 127) * s


def _expected(layer: Int8Linear, x: torch.Tensor, static: torch.Tensor | None = None) -> torch.Tensor:
    w = layer.weight.double() * layer.weight_scale.double()
    out = _fake_quant_rows(x.reshape(-1, x.shape[-1]), static) @ w.t()
    if layer.bias is not None:
        out = out + layer.bias.double()
    return out.reshape(*x.shape[:-1], -1)


def test_quantize_rounds_each_output_channel():
    layer = _float_layer(96, [40], bias=True, seed=0)
    q = METHOD.quantize(layer, METHOD.default_scheme())
    assert isinstance(q, Int8Linear) and q.weight.dtype == torch.int8 and q.weight_scale.shape == (40, 1)
    amax = layer.weight.detach().abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(q.weight_scale, amax / 127)
    assert q.weight.abs().max() == 127  # each row's largest weight lands on the last level
    err = (q.dequantized_weight() - layer.weight.detach()).abs()
    assert (err <= q.weight_scale / 2 * (1 + 1e-5)).all()  # round to nearest: at most half a step
    assert torch.equal(q.bias, layer.bias.detach())
    assert q.describe() == {"method": "int8", "weights": "int8 per-channel symmetric",
                            "activations": "int8 per-token dynamic"}


@pytest.mark.parametrize("shape", [(1, 96), (3, 96), (16, 96), (2, 20, 96)])
def test_layer_matches_independent_reference(shape):
    layer = METHOD.quantize(_float_layer(96, [24, 8, 8], bias=True, seed=1), Int8Scheme())
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[0])
    x = torch.randn(*shape, generator=g) * 3
    out = layer(x)
    assert out.shape == (*shape[:-1], 40) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _expected(layer, x), rtol=1e-5, atol=1e-5)
    assert [t.shape[-1] for t in layer.split_output(out)] == [24, 8, 8]


@pytest.mark.skipif(not dispatch.interpreter_active(), reason="needs TRITON_INTERPRET=1")
def test_layer_routes_decode_rows_through_the_gemv(monkeypatch):
    """Rows up to gemv_max_rows take the Triton GEMV (interpreted here) with the layer's own counters and give
    the reference path's numbers exactly; more rows, or kernels off, never call it."""
    from flashvlm.kernels import int8_gemv

    calls = []
    real = int8_gemv.w8a8_gemv
    monkeypatch.setattr(int8_gemv, "w8a8_gemv", lambda *a, **kw: calls.append(kw["locks"]) or real(*a, **kw))
    monkeypatch.setattr("flashvlm.quant.int8.use_triton", lambda x, enabled=None, force=False: enabled is not False)
    layer = METHOD.quantize(_float_layer(1024, [48, 16], bias=True, seed=2), Int8Scheme())  # long K: split-K
    x = torch.randn(4, 1024)
    out = layer(x)
    assert len(calls) == 1 and calls[0] is layer.gemv_locks and not layer.gemv_locks.any()
    layer.use_triton_kernels = False
    assert torch.equal(out, layer(x)) and len(calls) == 1
    layer.use_triton_kernels = True
    layer(torch.randn(17, 1024))
    assert len(calls) == 1


def test_merged_checkpoint_shards_load_in_place():
    """empty_layer is shaped like the checkpoint; each projection's weight, scale and bias fill its rows; static
    input scales of merged projections fold to their largest."""
    float_layer = _float_layer(32, [16, 8, 8], bias=True, seed=3)
    layer = METHOD.empty_layer(float_layer, Int8Scheme(static_activations=True))
    assert layer.weight.shape == (32, 32) and layer.input_scale.shape == (3,)
    assert not layer.weight.requires_grad
    g = torch.Generator().manual_seed(3)
    shards = [(torch.randint(-128, 128, (n, 32), generator=g, dtype=torch.int8), torch.rand(n, 1, generator=g),
               torch.randn(n, generator=g), torch.tensor([s])) for n, s in zip([16, 8, 8], [0.02, 0.05, 0.03])]
    for i, (w, s, b, xs) in enumerate(shards):
        layer.load_shard("weight", i, w)
        layer.load_shard("weight_scale", i, s)
        layer.load_shard("bias", i, b)
        layer.load_shard("input_scale", i, xs)
    layer.finish_loading()
    assert torch.equal(layer.weight, torch.cat([s[0] for s in shards]))
    assert torch.equal(layer.weight_scale, torch.cat([s[1] for s in shards]))
    assert layer.x_scale.item() == pytest.approx(0.05)
    x = torch.randn(5, 32)
    torch.testing.assert_close(layer(x).double(), _expected(layer, x, torch.tensor(0.05)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expected"):
        layer.load_shard("weight", 1, torch.zeros(16, 32, dtype=torch.int8))
    layer.load_shard("weight_zero_point", 1, torch.zeros(8, 1, dtype=torch.int8))  # symmetric: zeros, ignored
    with pytest.raises(QuantFormatError, match="non-zero"):
        layer.load_shard("weight_zero_point", 1, torch.ones(8, 1, dtype=torch.int8))
    with pytest.raises(QuantFormatError, match="one per-tensor scale"):
        layer.load_shard("input_scale", 0, torch.ones(2))
    layer.input_scale.data[:] = 0
    with pytest.raises(QuantFormatError, match="positive"):
        layer.finish_loading()


def test_plain_linear_layers_and_static_rtn():
    layer = METHOD.empty_layer(Linear(16, 8, bias=False), Int8Scheme())
    assert layer.out_sizes == [8] and layer.bias is None and layer.input_scale is None
    with pytest.raises(QuantFormatError, match="per token"):
        METHOD.quantize(Linear(16, 8, bias=False), Int8Scheme(static_activations=True))
    assert METHOD.is_quantized_tensor("model.layers.0.mlp.down_proj.weight_scale")
    assert not METHOD.is_quantized_tensor("model.layers.0.mlp.down_proj.weight")


def test_reads_llm_compressor_configs():
    assert METHOD.scheme_from_checkpoint(int8_quantization_config()) == Int8Scheme(static_activations=False)
    assert METHOD.scheme_from_checkpoint(int8_quantization_config(True)) == Int8Scheme(static_activations=True)
    naive = int8_quantization_config()
    naive["format"] = "naive-quantized"
    del naive["config_groups"]["group_0"]["format"]
    assert METHOD.scheme_from_checkpoint(naive) == Int8Scheme()
    inferred = int8_quantization_config()  # strategies left out: compressed-tensors infers them from group_size
    inferred["config_groups"]["group_0"]["weights"].update(strategy=None, group_size=-1)
    assert METHOD.scheme_from_checkpoint(inferred) == Int8Scheme()
    inferred["config_groups"]["group_0"]["weights"].update(group_size=None)
    with pytest.raises(QuantFormatError, match="'tensor' weight scales"):
        METHOD.scheme_from_checkpoint(inferred)


def _edited(path: str, value, static: bool = False) -> dict:
    qc = copy.deepcopy(int8_quantization_config(static))
    *keys, last = path.split(".")
    node = qc
    for key in keys:
        node = node[key]
    if value is None:
        node.pop(last)
    else:
        node[last] = value
    return qc


@pytest.mark.parametrize("path,value,match", [
    ("config_groups.group_0.weights.symmetric", False, "asymmetric weights"),
    ("config_groups.group_0.input_activations.symmetric", False, "asymmetric input activations"),
    ("config_groups.group_0.input_activations", None, "W8A16"),
    ("config_groups.group_0.weights.strategy", "group", "'group' weight scales"),
    ("config_groups.group_0.weights.dynamic", True, "dynamic weight scales"),
    ("config_groups.group_0.input_activations.strategy", "tensor", "strategy='tensor', dynamic=True"),
    ("config_groups.group_0.input_activations.num_bits", 4, "4-bit int input activations"),
    ("config_groups.group_0.format", "marlin-24", "format 'marlin-24'"),
    ("config_groups.group_0.output_activations", {"num_bits": 8}, "output activations"),
])
def test_refuses_int8_variants_it_cannot_run(path, value, match):
    with pytest.raises(QuantFormatError, match=match):
        METHOD.scheme_from_checkpoint(_edited(path, value))


def test_leaves_other_formats_to_other_methods():
    fp8 = _edited("config_groups.group_0.weights.type", "float")
    fp8["format"] = "float-quantized"
    assert METHOD.scheme_from_checkpoint(fp8) is None
    packed = _edited("config_groups.group_0.weights.num_bits", 4)
    assert METHOD.scheme_from_checkpoint(packed) is None
    w8a16_packed = _edited("config_groups.group_0.input_activations", None)
    w8a16_packed["format"] = "pack-quantized"
    assert METHOD.scheme_from_checkpoint(w8a16_packed) is None
    assert METHOD.scheme_from_checkpoint({"quant_method": "fp8", "weight_block_size": [128, 128]}) is None
    mixed = int8_quantization_config()
    mixed["config_groups"]["group_1"] = {"targets": ["re:.*down_proj"], "weights": {"num_bits": 4, "type": "int"}}
    with pytest.raises(QuantFormatError, match="several schemes"):
        METHOD.scheme_from_checkpoint(mixed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._int_mm's CUDA path and the compiled GEMV")
@pytest.mark.parametrize("gemv_rows", [16, 0], ids=["gemv", "int_mm-only"])
def test_cuda_paths_match_the_reference(gemv_rows):
    """bf16 on CUDA: the GEMV (<= 16 rows), torch._int_mm (rows padded to 17 below that) and the torch backend
    against the reference of the same layer; one bf16 rounding of the output, rare one-step activation flips."""
    layer = METHOD.quantize(_float_layer(256, [64, 32, 32], bias=True, seed=4), Int8Scheme()).cuda()
    layer.bias.data = layer.bias.data.bfloat16()
    layer.gemv_max_rows = gemv_rows
    for rows in (1, 5, 16, 17, 40):
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        expected = _expected(layer, x.float())
        for kernels in (True, False):
            layer.use_triton_kernels = kernels
            out = layer(x)
            assert out.dtype == torch.bfloat16
            torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_cpu_path_never_imports_triton():
    """The method, its layer and the torch references import no Triton: CPU processes never pay for it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, torch, flashvlm.quant.int8 as m; layer = m.Int8Method().quantize("
            "torch.nn.Linear(16, 8), m.Int8Scheme()); layer(torch.randn(2, 16)); print('triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"
