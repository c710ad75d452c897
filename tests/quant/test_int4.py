"""INT4 W4A16 layers (quant/int4.py) and the pack-quantized format (quant/int4_format.py): rounding and packing
against compressed-tensors' own functions where the library is installed, the layers against references
written here from the float weights, checkpoint loading through shards, and the formats refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

from flashvlm.kernels import dispatch  # noqa: E402
from flashvlm.layers.linear import Linear, MergedLinear  # noqa: E402
from flashvlm.quant.base import QuantFormatError  # noqa: E402
from flashvlm.quant.int4 import Int4Linear, Int4Method, Int4Scheme  # noqa: E402
from flashvlm.quant.int4_format import compress, decompress, pack_rows, rtn_codes, unpack_rows  # noqa: E402
from flashvlm.testing.quantized_int4 import pack_quantized_config  # noqa: E402

METHOD = Int4Method()
needs_interpreter = pytest.mark.skipif(not (dispatch.interpreter_active() and dispatch.triton_available()),
                                       reason="the kernels on CPU tensors need TRITON_INTERPRET=1")


def _fake_quant(w: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """Round-to-nearest written out per group, independent of quant/int4_format.py."""
    out = torch.empty_like(w)
    for start in range(0, w.shape[1], group_size):
        g = w[:, start:start + group_size]
        lo, hi = g.min(dim=1, keepdim=True).values.clamp(max=0), g.max(dim=1, keepdim=True).values.clamp(min=0)
        if symmetric:
            s, z = torch.maximum(-lo, hi) / 7.5, torch.zeros_like(lo)
        else:
            s = (hi - lo) / 15
            z = torch.clamp(torch.round(-8 - lo / s), -8, 7)
        out[:, start:start + group_size] = (torch.clamp(torch.round(g / s + z), -8, 7) - z) * s
    return out


def _float_layer(out_sizes: list[int], k: int, bias: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = MergedLinear(k, out_sizes, bias) if len(out_sizes) > 1 else Linear(k, out_sizes[0], bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        if bias:
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (128, True), (None, False)])
def test_quantize_matches_round_to_nearest(group_size, symmetric) -> None:
    k = 256
    layer = _float_layer([40, 24], k, bias=True, seed=1)
    q = METHOD.quantize(layer, Int4Scheme(group_size=group_size, symmetric=symmetric))
    assert isinstance(q, Int4Linear) and q.out_sizes == [40, 24]
    x = torch.randn(5, k)
    expected = F.linear(x, _fake_quant(layer.weight.detach(), group_size or k, symmetric), layer.bias)
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-5)
    assert q(x.view(5, 1, k)).shape == (5, 1, 64)


@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=needs_interpreter),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))])
def test_layer_kernels_match_the_reference_path(device, rows) -> None:
    """GEMV (3 rows) and GEMM (20 rows) through the layer against its dequantize-then-linear path: on CPU
    forced through the interpreter in float32, on CUDA as the engine runs them, in bfloat16."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layer = _float_layer([48], 160, bias=True, seed=2).to(device, dtype)
    q = METHOD.quantize(layer, Int4Scheme(group_size=32, symmetric=False))
    x = torch.randn(rows, 160).to(device, dtype)
    out = q.product(x, force=True) if device == "cpu" else q(x)
    q.use_triton_kernels = False
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, q(x), rtol=tol, atol=tol)


def test_default_scheme_is_group_128_symmetric() -> None:
    assert METHOD.default_scheme() == Int4Scheme(bits=4, group_size=128, symmetric=True)
    q = METHOD.quantize(_float_layer([16], 128, bias=False, seed=0), METHOD.default_scheme())
    assert q.describe() == {"method": "int4", "weights": "int4 group 128 symmetric", "activations": "float32"}


def test_format_round_trip_and_layout() -> None:
    w = torch.randn(20, 96)
    t = compress(w, 32, symmetric=False)
    assert t["weight_packed"].shape == (20, 12) and t["weight_packed"].dtype == torch.int32
    assert t["weight_scale"].shape == (20, 3) and t["weight_zero_point"].shape == (3, 3)
    assert t["weight_shape"].tolist() == [20, 96]
    torch.testing.assert_close(decompress(t, 32, torch.float32), _fake_quant(w, 32, False))
    codes = torch.randint(0, 16, (3, 21))
    assert torch.equal(unpack_rows(pack_rows(codes), 21).long(), codes)
    assert (pack_rows(codes)[0, 0] >> 4) & 15 == codes[0, 1]  # input 8j + i in nibble i of word j


@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (128, False)])
def test_format_matches_compressed_tensors(group_size, symmetric) -> None:
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor, pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    assert ct is not None
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(group_size)).to(torch.bfloat16)
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group_size, symmetric=symmetric)
    grouped = w.view(24, -1, group_size)  # the observer's min and max, in the weight's dtype
    scale, zp = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
    codes, ours_scale, ours_zero = rtn_codes(w, group_size, symmetric, torch.bfloat16)
    assert torch.equal(ours_scale, scale)
    if not symmetric:
        assert torch.equal(ours_zero.long() - 8, zp.long())
    # packing, weights along K and zero points along N, as the library's packer
    assert torch.equal(pack_rows(codes), pack_to_int32((codes.long() - 8).to(torch.int8), 4))
    ours = compress(w, group_size, symmetric)
    if not symmetric:
        lib_zp = pack_to_int32((ours_zero.long() - 8).to(torch.int8), 4, packed_dim=0)
        assert torch.equal(ours["weight_zero_point"], lib_zp)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    lib = PackedQuantizationCompressor.decompress(dict(ours), scheme)["weight"]
    torch.testing.assert_close(decompress(ours, group_size, torch.bfloat16), lib.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_empty_layer_loads_shards(symmetric) -> None:
    """q/k/v shards of 20, 12 and 12 rows: zero points packed 8 rows a word do not fall on shard edges."""
    k, sizes = 128, [20, 12, 12]
    template = _float_layer(sizes, k, bias=True, seed=3)
    layer = METHOD.empty_layer(template, Int4Scheme(group_size=64, symmetric=symmetric))
    names = {n for n, _ in layer.named_parameters()}
    assert {"weight_packed", "weight_scale", "weight_shape"} <= names
    assert ("weight_zero_point" in names) == (not symmetric)
    weights, biases = [], []
    for shard, rows in enumerate(sizes):
        w = torch.randn(rows, k)
        tensors = compress(w, 64, symmetric, torch.float32)
        with torch.no_grad():
            for name, t in tensors.items():
                layer.load_shard(name, shard, t)
            biases.append(torch.randn(rows))
            layer.load_shard("bias", shard, biases[-1])
        weights.append(decompress(tensors, 64, torch.float32))
    layer.finish_loading()
    assert not hasattr(layer, "weight_packed") and layer.qweight.dtype == torch.int32
    x = torch.randn(4, k)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat(weights), torch.cat(biases)), rtol=1e-5, atol=1e-5)


def test_a_wrong_weight_shape_is_refused() -> None:
    layer = METHOD.empty_layer(_float_layer([16, 16], 64, bias=False, seed=4), Int4Scheme(group_size=32))
    with pytest.raises(QuantFormatError, match="weight_shape"):
        layer.load_shard("weight_shape", 1, torch.tensor([16, 32]))


@pytest.mark.parametrize("group_size,symmetric", [(32, True), (64, False), (128, True), (256, False), (None, True)])
def test_checkpoint_schemes_accepted(group_size, symmetric) -> None:
    qc = pack_quantized_config(group_size, symmetric)
    assert METHOD.scheme_from_checkpoint(qc) == Int4Scheme(group_size=group_size, symmetric=symmetric)
    assert METHOD.scheme_from_checkpoint({**qc, "format": "mixed-precision"}) is not None  # per-group format


@pytest.mark.parametrize("overrides,message", [
    (dict(num_bits=8), "8-bit weights"),
    (dict(group_size=48), "group size 48"),
    (dict(actorder="group"), "g_idx"),
    (dict(strategy="block", group_size=None, block_structure=[128, 128]), "'block' strategy"),
    (dict(dynamic=True), "dynamic"),
])
def test_checkpoint_schemes_refused(overrides, message) -> None:
    with pytest.raises(QuantFormatError, match=message):
        METHOD.scheme_from_checkpoint(pack_quantized_config(128, True, overrides))


def test_other_formats_are_refused_or_left_to_other_methods() -> None:
    qc = pack_quantized_config(128, True)
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True}
    with pytest.raises(QuantFormatError, match="activation quantization"):
        METHOD.scheme_from_checkpoint(qc)
    for method, name in (("awq", "AWQ"), ("gptq", "GPTQ")):
        with pytest.raises(QuantFormatError, match=f"{name} checkpoints .* not supported"):
            METHOD.scheme_from_checkpoint({"quant_method": method, "bits": 4, "group_size": 128})
    float_quantized = {**pack_quantized_config(128, True), "format": "float-quantized"}
    float_quantized["config_groups"]["group_0"]["format"] = "float-quantized"
    assert METHOD.scheme_from_checkpoint(float_quantized) is None
    assert METHOD.scheme_from_checkpoint({"quant_method": "fp8", "weight_block_size": [128, 128]}) is None
    assert METHOD.is_quantized_tensor("model.layers.0.mlp.down_proj.weight_packed")
    assert not METHOD.is_quantized_tensor("model.layers.0.mlp.down_proj.weight_scale")
    with pytest.raises(QuantFormatError, match="g_idx"):
        METHOD.is_quantized_tensor("model.layers.0.mlp.down_proj.weight_g_idx")
