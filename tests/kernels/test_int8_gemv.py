"""The W8A8 kernels (kernels/int8_gemv.py) against their plain-torch references (kernels/int8_torch.py).

Without CUDA the kernels run on CPU tensors in Triton's interpreter, where every step (IEEE division, the floor
form of round-half-even, int32 sums) matches the reference bit for bit, so float32 outputs are compared exactly.
With CUDA they run compiled in bfloat16 against the reference of the same inputs: one rounding of the output, and
rarely one quantized activation off by one where the GPU's fused multiply-adds move a value across a tie.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

pytest.importorskip("triton")

from flashvlm.kernels import dispatch  # noqa: E402
from flashvlm.kernels import int8_gemv as kmod  # noqa: E402
from flashvlm.kernels.int8_gemv import (  # noqa: E402
    Int8GemvConfig,
    dequantize_product_triton,
    int8_gemv_config,
    int8_gemv_lock_count,
    quantize_rows,
    w8a8_gemv,
)
from flashvlm.kernels.int8_torch import (  # noqa: E402
    dequantize_product,
    int_mm_w8a8,
    quantize_rows_reference,
    w8a8_reference,
)

INTERPRETED = type(kmod._w8a8_gemv_kernel).__name__ == "InterpretedFunction"
_CPU_OK = INTERPRETED and dispatch.interpreter_active()
_CUDA_OK = torch.cuda.is_available() and not INTERPRETED
CASES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1"),
                 id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not _CUDA_OK, reason="no CUDA"), id="cuda-bf16"),
]
# (rows, N, K): K not a multiple of the K block, N not a multiple of the column block.
SHAPES = [(1, 40, 96), (3, 100, 200), (16, 72, 300)]
# The default quantizes x inside the GEMV up to 4 rows and in a launch before it above; the other always inside.
CONFIGS = [None, Int8GemvConfig(32, 64, split_k=3, fuse_max_rows=16)]


def _inputs(device, dtype, rows, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4).to(device, dtype)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).to(device)
    scale = (torch.rand(n, generator=g) * 0.02 + 1e-3).to(device)
    bias = torch.randn(n, generator=g).to(device, dtype)
    return x, w, scale, bias


def _assert_matches(out, expected, dtype):
    if dtype == torch.float32:
        assert torch.equal(out, expected), (out - expected).abs().max()
    else:  # one bf16 rounding of the output, and rare one-step flips of a quantized activation
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "split3-fused"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_gemv_matches_reference(device, dtype, rows, n, k, config, static):
    x, w, scale, bias = _inputs(device, dtype, rows, n, k, seed=rows * 1000 + n + k)
    x_scale = torch.tensor([0.01], device=device) if static else None  # clips the larger activations
    cfg = config or int8_gemv_config(n, k)
    locks = torch.zeros(int8_gemv_lock_count(n, cfg), dtype=torch.int32, device=device)
    out = w8a8_gemv(x, w, scale, bias, x_scale=x_scale, config=cfg, locks=locks)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert not locks.any()  # each column block's last program reset its counter
    assert torch.equal(out, w8a8_gemv(x, w, scale, bias, x_scale=x_scale, config=cfg, locks=locks))
    _assert_matches(out, w8a8_reference(x, w, scale, bias, x_scale=x_scale), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.slow
@pytest.mark.parametrize("config", [Int8GemvConfig(16, 32), Int8GemvConfig(64, 128, split_k=8, num_stages=2),
                                    Int8GemvConfig(32, 256, split_k=2)], ids=["small", "split8", "split2"])
def test_gemv_more_tilings(device, dtype, config):
    for rows, n, k in [(2, 257, 1000), (7, 48, 1024), (16, 130, 520)]:
        x, w, scale, bias = _inputs(device, dtype, rows, n, k, seed=rows + n + k)
        _assert_matches(w8a8_gemv(x, w, scale, None, config=config), w8a8_reference(x, w, scale, None), dtype)
        _assert_matches(w8a8_gemv(x, w, scale, bias, config=config), w8a8_reference(x, w, scale, bias), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_prequantized_rows_and_quantize_kernel(device, dtype):
    """quantize_rows gives the reference's integers and scales; the GEMV on those integers gives the fused
    kernel's answer; the _int_mm path (torch's int8 GEMM, CPU here) the reference's."""
    x, w, scale, bias = _inputs(device, dtype, 5, 64, 200, seed=7)
    x[2] = 0  # an all-zero row: scale 0, quantized to zeros, no division by zero
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_reference(x)
    assert s[2] == 0 and not q[2].any()
    if dtype == torch.float32:
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    else:
        assert (q.int() - q_ref.int()).abs().max() <= 1 and torch.equal(s, s_ref)
    fused = w8a8_gemv(x, w, scale, bias)
    _assert_matches(w8a8_gemv(q, w, scale, bias, x_scale=s, out_dtype=dtype), fused, dtype)
    _assert_matches(int_mm_w8a8(x, w, scale, bias, quantize=quantize_rows, epilogue=dequantize_product_triton),
                    w8a8_reference(x, w, scale, bias), dtype)
    static = torch.tensor([0.02], device=device)
    q, s = quantize_rows(x, static)
    assert torch.equal(s, torch.full((5,), 0.02, device=device))
    assert (q.int() - quantize_rows_reference(x, static)[0].int()).abs().max() <= (0 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("device,dtype", CASES)
def test_quantize_rows_longer_than_one_pass(device, dtype):
    """Rows past 32,768 inputs take the two-pass loop (amax, then rounding) instead of one load."""
    x, _, _, _ = _inputs(device, dtype, 2, 8, 33000, seed=11)
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_reference(x)
    assert torch.equal(s, s_ref)
    assert (q.int() - q_ref.int()).abs().max() <= (0 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,n", [(1, 40), (20, 300)])
def test_dequantize_epilogue(device, dtype, rows, n):
    g = torch.Generator().manual_seed(rows + n)
    acc = torch.randint(-(2**30), 2**30, (rows, n), generator=g, dtype=torch.int32).to(device)
    x_scale, w_scale = (torch.rand(rows, generator=g) * 1e-6).to(device), (torch.rand(n, generator=g) * 1e-2).to(device)
    bias = torch.randn(n, generator=g).to(device, dtype)
    for b in (None, bias):
        out = dequantize_product_triton(acc, x_scale, w_scale, b, dtype)
        expected = dequantize_product(acc, x_scale, w_scale, b, dtype)
        assert out.dtype == dtype
        if dtype == torch.float32:
            assert torch.equal(out, expected)
        else:  # the GPU may fuse the bias add into a multiply-add: at most one bf16 rounding apart
            torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1")
def test_rounding_is_half_to_even_and_clamped():
    """Row amax 127 gives scale 1, so x / s lands exactly on the ties: 2.5 -> 2, 3.5 -> 4, -0.5 -> -0."""
    x = torch.tensor([[127.0, 2.5, 3.5, -0.5, -1.5, 0.49, -127.0, 126.5] + [1.0] * 24])
    q, s = quantize_rows(x)
    assert s.item() == 1.0
    assert q[0, :8].tolist() == [127, 2, 4, 0, -2, 0, -127, 126]
    q, _ = quantize_rows(x, torch.tensor([0.5]))  # a static scale clips at +-127
    assert q[0, 0].item() == 127 and q[0, 6].item() == -127 and q[0, 1].item() == 5
    w = torch.eye(32, dtype=torch.int8)
    out = w8a8_gemv(x, w, torch.ones(32))
    assert out[0, :8].tolist() == [127.0, 2.0, 4.0, 0.0, -2.0, 0.0, -127.0, 126.0]


def test_int32_sums_are_exact():
    """The integer product is exact where float32 sums would round: a K of 4096 of 127 * 127 sums to 66 M."""
    k = 4096
    x = torch.full((1, k), 127.0)
    x[0, 0] = 126.0  # makes the sum odd and above 2^24, so a float32 accumulator could not hold it
    w = torch.full((8, k), 127, dtype=torch.int8)
    expected = 127 * 127 * (k - 1) + 126 * 127
    assert expected > 2**24 and expected % 2 == 1
    xq, _ = quantize_rows_reference(x)
    assert int((xq.double() @ w.double().t())[0, 0]) == expected
    if _CPU_OK:
        out = w8a8_gemv(x, w, torch.ones(8), config=Int8GemvConfig(16, 128, split_k=4))
        assert out[0, 0].item() == float(torch.tensor(expected, dtype=torch.float32))


@pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1")
def test_gemv_rejects_bad_operands():
    x, w, scale, _ = _inputs("cpu", torch.float32, 2, 16, 64, 0)
    with pytest.raises(ValueError, match="columns"):
        w8a8_gemv(x[:, :63], w, scale)
    with pytest.raises(ValueError, match="rows"):
        w8a8_gemv(torch.cat([x] * 9), w, scale)
    with pytest.raises(ValueError, match="int8 weight"):
        w8a8_gemv(x, w.float(), scale)
    with pytest.raises(ValueError, match="weight_scale"):
        w8a8_gemv(x, w, scale.double())
    with pytest.raises(ValueError, match="row scales"):
        w8a8_gemv(x.to(torch.int8), w, scale)
    with pytest.raises(ValueError, match="locks"):
        w8a8_gemv(x, w, scale, config=Int8GemvConfig(16, 32, split_k=2), locks=torch.zeros(1))


def test_config_at_qwen2_7b_shapes():
    assert int8_gemv_config(37888, 3584).split_k == 1
    assert int8_gemv_config(3584, 3584).split_k == int8_gemv_config(3584, 18944).split_k == 2
    assert int8_gemv_config(4608, 3584).split_k == 1
