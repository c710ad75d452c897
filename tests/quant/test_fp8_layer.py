"""The FP8 layer (flashvlm/quant/fp8*.py) against a plain-torch reference of its numbers written here, on fresh
random inputs: rounding float weights, loading checkpoint-shaped tensors into merged layers, every scheme."""

from __future__ import annotations

import contextlib

import pytest
import torch

from flashvlm.kernels.fp8_quant import quantize_fp8_per_token_reference
from flashvlm.layers.linear import Linear, MergedLinear
from flashvlm.quant.base import QuantFormatError
from flashvlm.quant.fp8 import Fp8Method
from flashvlm.quant.fp8_formats import Fp8Scheme
from flashvlm.quant.fp8_linear import Fp8Linear
from flashvlm.testing.quantized_fp8 import fp8_round_trip, fp8_scale, round_activation

FP8 = torch.float8_e4m3fn


# ---- the reference: the scheme's math, written independently of flashvlm.quant (flashvlm/testing) ------------
ref_round, ref_scale, ref_activation = fp8_round_trip, fp8_scale, round_activation


def ref_product(x_deq: torch.Tensor, w_deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x_deq @ w_deq.t()
    return out if bias is None else out + bias.float()


def _float_layer(out_sizes: list[int], k: int, bias: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layer = MergedLinear(k, out_sizes, bias) if len(out_sizes) > 1 else Linear(k, out_sizes[0], bias)
    with torch.no_grad():
        layer.weight.normal_(0.0, 0.05)
        layer.weight[3].zero_()  # an all-zero row must not divide by zero
        if bias:
            layer.bias.normal_()
    return layer


def _inputs(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[1].zero_()  # and neither must an all-zero token
    return x


# ---- --quantization fp8: rounding a float layer ---------------------------------------------------------------
@pytest.mark.parametrize("weight", ["channel", "tensor"])
@pytest.mark.parametrize("activation", ["dynamic", None])
@pytest.mark.parametrize("out_sizes", [[96], [64, 32, 32]])
def test_quantized_float_layer_matches_reference(weight, activation, out_sizes) -> None:
    layer = _float_layer(out_sizes, 80, bias=True, seed=len(out_sizes) + 7 * (weight == "tensor"))
    fp8 = Fp8Method().quantize(layer, Fp8Scheme(weight, activation))
    w = layer.weight.detach().float()
    if weight == "channel":
        w_deq = ref_round(w, ref_scale(w.abs().amax(dim=1, keepdim=True)))
    else:
        w_deq = torch.cat([ref_round(p, ref_scale(p.abs().amax())) for p in w.split(out_sizes)])
    # e4m3 keeps 3 mantissa bits: each weight within half a step (2^-4 relative) of the largest in its scale group
    assert ((w_deq - w).abs() <= w.abs().amax(dim=1, keepdim=True) / 16 + 1e-12).all()
    assert (w_deq[3] == 0).all()
    for seed in range(3):
        x = _inputs(5, 80, seed)
        expected = ref_product(ref_activation(x, activation), w_deq, layer.bias)
        out = fp8(x)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert fp8.split_output(out)[0].shape[-1] == out_sizes[0]
    # the fp8 product is close to the float one (rounding error ~ 2^-4 relative per factor)
    x = _inputs(5, 80, 9)
    exact = layer(x).detach()
    assert (fp8(x) - exact).abs().max() <= 0.1 * exact.abs().max()


def test_quantize_keeps_leading_dimensions() -> None:
    layer = _float_layer([48], 32, bias=False, seed=1)
    fp8 = Fp8Method().quantize(layer, Fp8Method().default_scheme())
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(fp8(x), fp8(x.reshape(6, 32)).reshape(2, 3, 48))


def test_quantize_refuses_schemes_that_need_a_checkpoint() -> None:
    layer = _float_layer([32], 32, bias=False, seed=2)
    with pytest.raises(QuantFormatError, match="pre-quantized"):
        Fp8Method().quantize(layer, Fp8Scheme("channel", "static"))


def test_quantize_block_scaled() -> None:
    """Random weights benchmarked under a block-scaled checkpoint's scheme: tiles of each projection."""
    sizes, k, block = [64, 32, 32], 96, (16, 32)
    layer = _float_layer(sizes, k, bias=True, seed=6)
    fp8 = Fp8Method().quantize(layer, Fp8Scheme("block", "dynamic", block))
    w_parts = []
    for part in layer.weight.detach().float().split(sizes):
        tiles = [[part[i:i + 16, j:j + 32] for j in range(0, k, 32)] for i in range(0, len(part), 16)]
        w_parts.append(torch.cat([torch.cat([ref_round(t, ref_scale(t.abs().amax())) for t in row], dim=1)
                                  for row in tiles]))
    x = _inputs(4, k, 8)
    expected = ref_product(ref_activation(x, "dynamic", group=32), torch.cat(w_parts), layer.bias)
    torch.testing.assert_close(fp8(x), expected, rtol=1e-5, atol=1e-5)


# ---- loading checkpoint-shaped tensors -------------------------------------------------------------------------
def _checkpoint_projection(n: int, k: int, granularity: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, scale as llm-compressor stores it: (n, 1) bf16 per channel, (1,) or () per tensor)."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if granularity == "channel":
        scale = ref_scale(w.abs().amax(dim=1, keepdim=True)).bfloat16()
    else:
        scale = ref_scale(w.abs().amax()).bfloat16().reshape((1,) if seed % 2 else ())
    q = torch.clamp(w / scale.float().reshape(-1, 1), -448, 448).to(FP8)
    return q, scale


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
@pytest.mark.parametrize("activation", ["dynamic", "static", None])
def test_loaded_merged_layer_matches_reference(granularity, activation) -> None:
    sizes, k = [64, 32, 32], 48
    layer = Fp8Method().empty_layer(MergedLinear(k, sizes, bias=True), Fp8Scheme(granularity, activation))
    parts, input_scales = [], [0.02, 0.03, 0.025]
    for shard, n in enumerate(sizes):
        q, scale = _checkpoint_projection(n, k, granularity, seed=shard + 1)
        layer.load_shard("weight", shard, q)
        layer.load_shard("weight_scale", shard, scale)
        bias = torch.randn(n)
        layer.load_shard("bias", shard, bias)
        if activation == "static":
            layer.load_shard("input_scale", shard, torch.tensor([input_scales[shard]]))
        parts.append((q.float() * scale.float().reshape(-1, 1), bias))
    layer.finish_loading()
    assert layer.weight_scale.shape == (128,) and layer.weight_scale.dtype == torch.float32
    if activation == "static":
        assert layer.input_scale.shape == (1,)
    w_deq, bias = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    for seed in range(3):
        x = _inputs(4, k, seed) * 0.01 if activation == "static" else _inputs(4, k, seed)
        # q/k/v share one input: it is rounded once, with the largest of their calibrated scales
        expected = ref_product(ref_activation(x, activation, max(input_scales)), w_deq, bias)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_single_projection_takes_scalar_scales() -> None:
    layer = Fp8Method().empty_layer(Linear(32, 48, bias=False), Fp8Scheme("tensor", "static"))
    q, scale = _checkpoint_projection(48, 32, "tensor", seed=2)  # scale saved as ()
    layer.load_tensor("weight", q)
    layer.load_tensor("weight_scale", scale)
    layer.load_tensor("input_scale", torch.tensor(0.05))
    layer.finish_loading()
    x = _inputs(3, 32, 5) * 0.1
    expected = ref_product(ref_activation(x, "static", 0.05), q.float() * scale.float(), None)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def _block_checkpoint(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    bn, bk = block
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[: min(bn, n), : min(bk, k)] *= 8  # tiles of different ranges
    nb, kb = -(-n // bn), -(-k // bk)
    scale = torch.stack([torch.stack([ref_scale(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().amax())
                                      for j in range(kb)]) for i in range(nb)])
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return torch.clamp(w / full, -448, 448).to(FP8), scale


@pytest.mark.parametrize("block,sizes,k", [((128, 128), [192, 64, 96], 320), ((16, 32), [64, 32, 32], 64)])
@pytest.mark.parametrize("scale_name", ["weight_scale_inv", "weight_scale"])
def test_block_scaled_layer_matches_reference(block, sizes, k, scale_name) -> None:
    scheme = Fp8Scheme("block", "dynamic", block, block_scale_name=scale_name)
    layer = Fp8Method().empty_layer(MergedLinear(k, sizes, bias=False), scheme)
    w_parts = []
    for shard, n in enumerate(sizes):
        q, scale = _block_checkpoint(n, k, block, seed=shard + 3)
        layer.load_shard("weight", shard, q)
        layer.load_shard(scale_name, shard, scale)
        w_parts.append(q.float() * scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k])
    layer.finish_loading()
    assert layer.weight_scale.shape == (sum(sizes), -(-k // block[1]))
    w_deq = torch.cat(w_parts)
    for seed in range(3):
        x = _inputs(6, k, seed)
        expected = ref_product(ref_activation(x, "dynamic", group=block[1]), w_deq, None)
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
        # the CUDA path for block weights (dequantize per call), run here on the CPU in float32
        torch.testing.assert_close(layer._forward_dequantized(x), expected, rtol=1e-5, atol=1e-5)


def test_scaled_mm_path_matches_reference() -> None:
    """The CUDA path of rows above the GEMV's (torch._scaled_mm with row-wise scales), run where torch's CPU build
    has _scaled_mm: same numbers as the reference up to its bfloat16 output."""
    layer = _float_layer([64, 32, 32], 64, bias=True, seed=4).to(torch.bfloat16)
    for activation in ("dynamic", "static"):
        fp8 = Fp8Method().quantize(layer, Fp8Scheme("channel", "dynamic"))
        if activation == "static":
            fp8.scheme = Fp8Scheme("channel", "static")
            fp8.input_scale = torch.nn.Parameter(torch.tensor([0.01]), requires_grad=False)
        x = (_inputs(24, 64, 3) * (0.1 if activation == "static" else 1)).bfloat16()
        try:
            out = fp8._forward_scaled_mm(x)
        except (RuntimeError, NotImplementedError) as exc:
            pytest.skip(f"torch._scaled_mm does not run on this CPU build: {exc}")
        expected = fp8(x).float()
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_e5m2_weights_are_refused() -> None:
    layer = Fp8Method().empty_layer(Linear(32, 32, bias=False), Fp8Method().default_scheme())
    with pytest.raises(QuantFormatError, match="float8_e5m2"):
        layer.load_tensor("weight", torch.randn(32, 32).to(torch.float8_e5m2))


def test_describe_names_the_formats() -> None:
    layer = Fp8Method().quantize(_float_layer([32], 32, bias=False, seed=5), Fp8Method().default_scheme())
    assert isinstance(layer, Fp8Linear)
    assert layer.describe() == {"method": "fp8", "weight": "e4m3 per channel",
                                "activation": "e4m3 dynamic per token"}


def test_cuda_dispatch_hands_the_gemv_its_contract(monkeypatch) -> None:
    """Which path a CUDA product takes, run here on CPU tensors with the GEMV replaced by a recording stand-in that
    computes the reference: rows <= gemv_max_rows get fp8_gemv(x, weight (N, K) e4m3, weight_scale (N,) float32,
    bias, input_scale=(1,) float32 or None, locks=int32 counters); more rows torch._scaled_mm; block weights the
    dequantized product."""
    import flashvlm.quant.fp8_linear as fp8_linear

    calls: list[dict] = []

    def fake_gemv(x, weight, weight_scale, bias=None, *, input_scale=None, locks=None):
        calls.append({"x": x, "weight": weight, "weight_scale": weight_scale, "bias": bias,
                      "input_scale": input_scale, "locks": locks})
        activation = "dynamic" if input_scale is None else "static"
        w_deq = weight.float() * weight_scale[:, None]
        scale = None if input_scale is None else input_scale.item()
        return ref_product(ref_activation(x, activation, scale), w_deq, bias).to(x.dtype)

    monkeypatch.setattr(fp8_linear, "_fp8_gemv", lambda: fake_gemv)
    monkeypatch.setattr(fp8_linear, "use_triton", lambda x, enabled=None, force=False: bool(enabled))
    layer = _float_layer([64, 32, 32], 64, bias=True, seed=7).to(torch.bfloat16)
    fp8 = Fp8Method().quantize(layer, Fp8Method().default_scheme())
    x = _inputs(16, 64, 1).bfloat16()
    torch.testing.assert_close(fp8._forward_cuda(x).float(), fp8(x).float(), rtol=1e-2, atol=1e-2)
    (call,) = calls
    assert call["weight"].dtype == FP8 and call["weight"].shape == (128, 64)
    assert call["weight_scale"].dtype == torch.float32 and call["weight_scale"].shape == (128,)
    assert call["input_scale"] is None and call["locks"].dtype == torch.int32 and call["bias"] is fp8.bias
    # past gemv_max_rows: the per-token quantizer (a recording stand-in: the Triton one cannot take CPU tensors on a
    # CUDA machine) and torch._scaled_mm (a CPU build without it raises); the GEMV must not run either way
    quantized: list[torch.Tensor] = []

    def fake_quantizer(x, *, input_scale=None):
        quantized.append(x)
        return quantize_fp8_per_token_reference(x, input_scale)

    monkeypatch.setattr(fp8_linear, "_fp8_quantizer", lambda: fake_quantizer)
    with contextlib.suppress(RuntimeError, NotImplementedError):
        fp8._forward_cuda(_inputs(17, 64, 2).bfloat16())
    assert len(calls) == 1 and len(quantized) == 1 and quantized[0].shape == (17, 64)
    block = Fp8Method().quantize(layer, Fp8Scheme("block", "dynamic", (16, 32)))
    torch.testing.assert_close(block._forward_cuda(x).float(), block(x).float(), rtol=2e-2, atol=2e-2)
    assert len(calls) == 1
