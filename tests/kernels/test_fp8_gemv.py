"""The FP8 GEMV (kernels/fp8_gemv.py) and per-token FP8 quantization (kernels/fp8_quant.py) against their
plain-torch references.

Without CUDA the kernels run on CPU tensors through Triton's interpreter. Its float32 -> e4m3 conversion rounds
wrongly when rounding carries into the exponent, so there the kernels round in float32 arithmetic first
(`round_bits`, tested bit for bit below); everything else (the amax pass, the fused quantization, the fp8 /
fp16 / multiply-add products, split-K and its counters) runs the code the GPU compiles. With CUDA the compiled
kernels run with the hardware conversion and with `round_bits`, both against the same reference.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from flashvlm.kernels import dispatch  # noqa: E402
from flashvlm.kernels import fp8_gemv as fp8_gemv_mod  # noqa: E402
from flashvlm.kernels.fp8_gemv import (  # noqa: E402
    Fp8GemvConfig,
    fp8_gemv,
    fp8_gemv_config,
    fp8_gemv_lock_count,
    fp8_gemv_reference,
)
from flashvlm.kernels.fp8_quant import (  # noqa: E402
    quantize_fp8_per_token,
    quantize_fp8_per_token_reference,
    round_to_e4m3,
)

INTERPRETED = type(fp8_gemv_mod._fp8_gemv_kernel).__name__ == "InterpretedFunction"
_CPU_OK = INTERPRETED and dispatch.interpreter_active()
_CUDA_OK = torch.cuda.is_available() and not INTERPRETED
DEVICES = [
    pytest.param("cpu", None, marks=pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1"), id="cpu"),
    pytest.param("cuda", False, marks=pytest.mark.skipif(not _CUDA_OK, reason="no CUDA"), id="cuda-cvt"),
    pytest.param("cuda", True, marks=pytest.mark.skipif(not _CUDA_OK, reason="no CUDA"), id="cuda-round-bits"),
]


def _activations(rows: int, k: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Random rows of very different sizes: large (1e2), ordinary, small (1e-3, 1e-6) and one below the amax
    floor (1e-14), so the scales, the clamping and e4m3's subnormals are all reached."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.tensor([1.0, 1e2, 1e-3, 3.0, 1e-6, 0.5, 1e-14, 20.0])
    x = torch.randn(rows, k, generator=g) * sizes[torch.arange(rows) % len(sizes)][:, None]
    return x.to(device, dtype)


def _weights(n: int, k: int, device: str, seed: int, bias_dtype: torch.dtype | None):
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(n, generator=g) * 1e-3 + 1e-4
    b = torch.randn(n, generator=g).to(bias_dtype) if bias_dtype is not None else None
    return w.to(device), ws.to(device), None if b is None else b.to(device)


def _check_close(out: torch.Tensor, x, w, ws, b, input_scale, dot: str) -> None:
    """Against the reference's float32 value before its final rounding, computed on the CPU: the kernels sum in
    another order, and the interpreter's bf16 conversion truncates, so one output ulp (plus float32 summation
    noise) is allowed. Compiled e4m3 tensor-core products may accumulate with fewer bits than float32 (Hopper's
    FP8 MMA is reported to keep about 14): there each element may also be off by 2^-12 of its terms' magnitude sum."""
    x, w, ws, b = x.cpu(), w.cpu(), ws.cpu(), None if b is None else b.cpu()
    input_scale = None if input_scale is None else input_scale.cpu()
    exact = fp8_gemv_reference(x.float(), w, ws, None if b is None else b.float(), input_scale=input_scale)
    ulp = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    bound = ulp * exact.abs() + 1e-5 * exact.abs().max() + 1e-30
    if out.is_cuda and dot == "fp8":
        q, scales = quantize_fp8_per_token_reference(x, input_scale)
        bound += 2.0**-12 * (q.float().abs() @ w.float().abs().t()) * scales * ws[None, :]
    err = (out.float().cpu() - exact).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, {(err > bound).sum().item()} elements over"
    assert torch.equal(fp8_gemv_reference(x, w, ws, b, input_scale=input_scale), exact.to(out.dtype))


@pytest.mark.parametrize("device,round_bits", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("k", [300, 33000])  # one pass over the row, and several (one pass takes up to 32,768)
def test_quantize_per_token_matches_reference_bytes(device, round_bits, dtype, static, k):
    x = _activations(9, k, dtype, device, seed=3 + static)
    input_scale = None
    if static:  # small enough that the large rows clamp at +-448
        input_scale = torch.tensor([0.05], device=device)
    q, scales = quantize_fp8_per_token(x, input_scale=input_scale, round_bits=round_bits)
    q_ref, scales_ref = quantize_fp8_per_token_reference(x, input_scale)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (9, 1) and scales.dtype == torch.float32
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert q.float().abs().amax() == 448  # the amax element of each dynamic row; clamped ones when static
    if static:
        assert (q_ref.float().abs() == 448).sum() > 9


@triton.jit
def _round_kernel(v_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(v_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, round_to_e4m3(v), mask=offs < n)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_round_to_e4m3_bits(device):
    """The float32 rounding the interpreter relies on, against torch's conversion: every e4m3 value, every
    midpoint between neighbours (ties to even) and random values across the range, subnormals included."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].sort().values
    g = torch.Generator().manual_seed(0)
    v = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, (torch.rand(4096, generator=g) * 2 - 1) * 448,
                   torch.randn(4096, generator=g) * 0.01]).clamp(-448, 448)
    if (device == "cpu" and not _CPU_OK) or (device == "cuda" and not _CUDA_OK):
        pytest.skip(f"no Triton on {device}")
    v = v.to(device)
    out = torch.empty_like(v)
    _round_kernel[(triton.cdiv(v.numel(), 1024),)](v, out, v.numel(), BLOCK=1024)
    assert torch.equal(out.cpu(), v.cpu().to(torch.float8_e4m3fn).float())


# (rows, bias, static input scale, config): each row count with a fused single pass, split-K, the fp16 and
# multiply-add products, and x quantized by the separate launch. N, K are not multiples of any block.
CASES = [
    (1, True, False, None),
    (1, False, False, Fp8GemvConfig(32, 64, split_k=3, fuse_max_rows=1)),
    (1, True, False, Fp8GemvConfig(32, 64, dot="fma")),
    (3, False, False, Fp8GemvConfig(32, 64, split_k=4, dot="f16")),
    (3, True, True, Fp8GemvConfig(32, 128, split_k=2)),
    (3, True, False, Fp8GemvConfig(32, 64, split_k=2, dot="fma")),
    (16, True, False, None),
    (16, False, False, Fp8GemvConfig(32, 64, split_k=2, fuse_max_rows=16)),
    (16, False, True, Fp8GemvConfig(64, 64, dot="f16")),
]


@pytest.mark.parametrize("device,round_bits", DEVICES)
@pytest.mark.parametrize("rows", [4, 16])
def test_fp8_gemv_long_rows(device, round_bits, rows):
    """K past one step of the fused amax pass (4 loads of 4096 / rows elements, rows rounded to a power of two)."""
    _run_and_check(device, round_bits, torch.bfloat16, rows, True, False,
                   Fp8GemvConfig(32, 256, split_k=2, fuse_max_rows=16), n=40, k=(4 * 4096) // rows + 300)


def _run_and_check(device, round_bits, dtype, rows, bias, static, config, n=100, k=300, seed=0):
    x = _activations(rows, k, dtype, device, seed=seed + rows)
    w, ws, b = _weights(n, k, device, seed + rows, dtype if bias else None)
    input_scale = torch.tensor([0.02], device=device) if static else None
    cfg = (config or fp8_gemv_config(n, k))._replace(round_bits=round_bits)
    locks = torch.zeros(fp8_gemv_lock_count(n, cfg), dtype=torch.int32, device=device)
    out = fp8_gemv(x, w, ws, b, input_scale=input_scale, locks=locks, config=cfg)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert not locks.any()  # the last program of each column block reset its counter
    _check_close(out, x, w, ws, b, input_scale, cfg.dot)
    if cfg.split_k > 1:  # the counters were reusable, and the split sums in a fixed order
        assert torch.equal(fp8_gemv(x, w, ws, b, input_scale=input_scale, locks=locks, config=cfg), out)


@pytest.mark.parametrize("device,round_bits", DEVICES)
@pytest.mark.parametrize("rows,bias,static,config", CASES)
def test_fp8_gemv_matches_reference(device, round_bits, rows, bias, static, config):
    dtype = torch.float16 if rows == 3 else torch.bfloat16
    _run_and_check(device, round_bits, dtype, rows, bias, static, config)


@pytest.mark.slow
@pytest.mark.parametrize("device,round_bits", DEVICES)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("config", [None, Fp8GemvConfig(16, 32, split_k=8, num_stages=2),
                                    Fp8GemvConfig(32, 64, split_k=2, dot="f16", fuse_max_rows=1),
                                    Fp8GemvConfig(32, 64, dot="fma")], ids=["default", "split8", "f16", "fma"])
def test_fp8_gemv_grid(device, round_bits, rows, static, config):
    if config is not None and config.dot == "fma" and rows > 4:
        pytest.skip("the multiply-add product takes up to 4 rows")
    dtype = torch.float16 if rows == 5 else torch.bfloat16
    _run_and_check(device, round_bits, dtype, rows, True, static, config, n=200, k=700, seed=7)


def test_fp8_gemv_rejects_bad_inputs():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64).to(torch.float8_e4m3fn)
    ws = torch.ones(32)
    cases = [
        ((x[:, :63], w, ws), {}, "columns"),
        ((torch.cat([x] * 9), w, ws), {}, "rows"),
        ((x.float(), w, ws), {}, "bf16 or fp16"),
        ((x, w.to(torch.bfloat16), ws), {}, "float8_e4m3fn"),
        ((x, w.t().contiguous().t(), ws), {}, "contiguous"),
        ((x, w, ws.double()), {}, "weight_scale"),
        ((x, w, ws[:31]), {}, "weight_scale"),
        ((x, w, ws, torch.zeros(32)), {}, "bias"),
        ((x, w, ws), {"input_scale": torch.ones(2)}, "input_scale"),
        ((torch.cat([x] * 3), w, ws), {"config": Fp8GemvConfig(16, 32, dot="fma")}, "fma"),
        ((x, w, ws), {"config": Fp8GemvConfig(16, 16)}, "blocks"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            fp8_gemv(*args, **kwargs)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_per_token(x[0])


@pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1")
def test_fp8_gemv_rejects_bad_locks():
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w = torch.randn(32, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="locks"):
        fp8_gemv(x, w, torch.ones(32), config=Fp8GemvConfig(16, 32, split_k=2), locks=torch.zeros(1))


def test_fp8_gemv_config_at_qwen2_7b_shapes():
    """Wide matrices never split; narrow ones split K; every block is at least 16 columns, so a layer's
    cdiv(N, 16) counters always suffice; x is quantized by its own launch (measured faster than fused)."""
    assert fp8_gemv_config(37888, 3584).split_k == fp8_gemv_config(152064, 3584).split_k == 1
    assert fp8_gemv_config(3584, 3584).split_k == fp8_gemv_config(4608, 3584).split_k == 4
    assert fp8_gemv_config(3584, 18944).fuse_max_rows == 0
    for n, k in ((4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)):
        assert fp8_gemv_lock_count(n, fp8_gemv_config(n, k)) <= -(-n // 16)
