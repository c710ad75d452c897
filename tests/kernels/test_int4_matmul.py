"""The W4A16 GEMV and GEMM (kernels/int4_matmul.py) against the plain-torch reference of the same 4-bit
weights (kernels/int4_layout.py), and the plane layout's packing.

Without CUDA the kernels run on CPU tensors through Triton's interpreter in float32; with CUDA compiled, in
bfloat16 and float16, against a float32 product of the same rounded weights.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

pytest.importorskip("triton")

from flashvlm.kernels import dispatch  # noqa: E402
from flashvlm.kernels import int4_matmul as mod  # noqa: E402
from flashvlm.kernels.int4_layout import (  # noqa: E402
    BLOCK_K,
    pack_planes,
    padded_k,
    unpack_planes,
    w4a16_dequantize,
)
from flashvlm.kernels.int4_matmul import W4Config, gemm_config, gemv_config, w4a16_gemm, w4a16_gemv  # noqa: E402

INTERPRETED = type(mod._w4a16_gemv_kernel).__name__ == "InterpretedFunction"
_CPU_OK = INTERPRETED and dispatch.interpreter_active()
_CUDA_OK = torch.cuda.is_available() and not INTERPRETED
CASES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1"),
                 id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not _CUDA_OK, reason="no CUDA"), id="cuda-bf16"),
    pytest.param("cuda", torch.float16, marks=pytest.mark.skipif(not _CUDA_OK, reason="no CUDA"), id="cuda-fp16"),
]
GROUPS = [32, 64, 128]


def _cross(rows: list[int]) -> list:
    """Every (rows, group size, symmetric) combination; one per (rows, symmetric) runs by default (the group
    size cycling), the rest are marked slow."""
    out = []
    for i, m in enumerate(rows):
        for j, sym in enumerate((True, False)):
            for gi, g in enumerate(GROUPS):
                fast = gi == (i + j) % len(GROUPS)
                out.append(pytest.param(m, g, sym, id=f"m{m}-g{g}-{'sym' if sym else 'asym'}",
                                        marks=() if fast else pytest.mark.slow))
    return out


def _weights(device, dtype, n, k, group_size, symmetric, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    groups = -(-k // group_size)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.005).to(device, dtype)
    zeros = None if symmetric else torch.randint(0, 16, (groups, n), generator=g, dtype=torch.uint8).to(device)
    return pack_planes(codes).to(device), scales, zeros


def _inputs(device, dtype, m, n, k, group_size, symmetric, bias, seed):
    qweight, scales, zeros = _weights(device, dtype, n, k, group_size, symmetric, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, qweight, scales, zeros, b


def _expected(x, qweight, scales, zeros, group_size, b):
    """float32 product of the same rounded weights (what the kernel multiplies)."""
    w = w4a16_dequantize(qweight, scales, zeros, group_size, x.shape[1], x.dtype).float()
    y = x.float() @ w.t()
    return y + b.float() if b is not None else y


def _close(out, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tol * max(scale, 1.0), (out.float() - ref).abs().max()


def test_plane_packing_round_trips() -> None:
    codes = torch.randint(0, 16, (5, 300), generator=torch.Generator().manual_seed(3))
    q = pack_planes(codes)
    assert q.shape == (5, padded_k(300) // 8) and q.dtype == torch.int32
    assert torch.equal(unpack_planes(q, 300).long(), codes)
    # nibble i of word j in a block holds input 32 i + j
    assert (q[0, 1] >> 4) & 15 == codes[0, 33] and (q[0, 31] >> 28) & 15 == codes[0, 255]


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m,group_size,symmetric", _cross([1, 5, 16]))
def test_gemv_matches_reference(device, dtype, m, group_size, symmetric) -> None:
    n, k = 72, 384  # K: one and a half 256-input blocks; N: not a multiple of the column block
    x, q, s, z, b = _inputs(device, dtype, m, n, k, group_size, symmetric, bias=m == 5, seed=m + group_size)
    out = w4a16_gemv(x, q, s, z, group_size, b, config=W4Config(64, split_k=2, swap=m == 16))
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, _expected(x, q, s, z, group_size, b), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("config", [None, W4Config(16), W4Config(16, split_k=3), W4Config(16, split_k=2, swap=True)],
                         ids=["default", "n16", "split3", "swap-split2"])
def test_gemv_configs_and_ragged_k(device, dtype, config) -> None:
    x, q, s, z, b = _inputs(device, dtype, 3, 40, 96, 32, False, bias=True, seed=7)  # K below one block
    _close(w4a16_gemv(x, q, s, z, 32, b, config=config), _expected(x, q, s, z, 32, b), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_gemv_locks_are_reset_for_the_next_call(device, dtype) -> None:
    x, q, s, z, _ = _inputs(device, dtype, 2, 32, 512, 64, True, bias=False, seed=11)
    locks = torch.zeros(2, dtype=torch.int32, device=device)
    cfg = W4Config(16, split_k=2)
    first = w4a16_gemv(x, q, s, z, 64, config=cfg, locks=locks)
    assert torch.count_nonzero(locks) == 0
    second = w4a16_gemv(x, q, s, z, 64, config=cfg, locks=locks)
    assert torch.equal(first, second)  # the fixed-order reduction is deterministic


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m,group_size,symmetric", _cross([17, 64]))
def test_gemm_matches_reference(device, dtype, m, group_size, symmetric) -> None:
    n, k = 48, 320
    x, q, s, z, b = _inputs(device, dtype, m, n, k, group_size, symmetric, bias=m == 17, seed=m * group_size)
    out = w4a16_gemm(x, q, s, z, group_size, b, config=W4Config(32, block_m=32))
    assert out.shape == (m, n)
    _close(out, _expected(x, q, s, z, group_size, b), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("m", [1, 16, 200])
def test_default_configs_at_a_larger_shape(device, dtype, m) -> None:
    n, k = 160, 3 * BLOCK_K
    x, q, s, z, b = _inputs(device, dtype, m, n, k, 128, False, bias=True, seed=m)
    out = w4a16_gemv(x, q, s, z, 128, b) if m <= 16 else w4a16_gemm(x, q, s, z, 128, b)
    _close(out, _expected(x, q, s, z, 128, b), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
def test_single_group_covering_k(device, dtype) -> None:
    """Channel scales: one group of all K inputs, K not a multiple of 32 (a plane still lies in one group)."""
    x, q, s, z, b = _inputs(device, dtype, 18, 24, 100, 100, False, bias=False, seed=5)
    assert s.shape == (1, 24)
    _close(w4a16_gemv(x[:2], q, s, z, 100, config=W4Config(16)), _expected(x[:2], q, s, z, 100, None), dtype)
    _close(w4a16_gemm(x, q, s, z, 100, config=W4Config(16, block_m=16)), _expected(x, q, s, z, 100, None), dtype)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("group_size,symmetric", [(64, True), (128, False)])
def test_dequantize_kernel_gives_the_reference_weight(device, dtype, group_size, symmetric) -> None:
    """The many-row path's weight (dequantized for cuBLAS) is the reference's, element for element; the default
    GEMM at DEQUANTIZE_MIN_ROWS rows takes that path on CUDA."""
    n, k = 70, 600  # N past one 64-row block, K ragged in its last 256-input block
    q, s, z = _weights(device, dtype, n, k, group_size, symmetric, seed=group_size)
    w = mod.w4a16_dequantize_triton(q, s, z, group_size, k, dtype)
    assert w.shape == (n, k) and w.dtype == dtype
    assert torch.equal(w, w4a16_dequantize(q, s, z, group_size, k, dtype))
    m = mod.DEQUANTIZE_MIN_ROWS
    x, q, s, z, b = _inputs(device, dtype, m, n, k, group_size, symmetric, bias=True, seed=3)
    _close(w4a16_gemm(x, q, s, z, group_size, b), _expected(x, q, s, z, group_size, b), dtype)


def test_configs_by_shape() -> None:
    assert gemv_config(37888, 3584).split_k < gemv_config(3584, 3584).split_k < gemv_config(3584, 18944).split_k
    assert gemm_config(17, 4608).block_m == 64 and gemm_config(2048, 4608).block_m == 128


def test_bad_arguments_are_refused() -> None:
    q, s, z = _weights("cpu", torch.float32, 8, 64, 32, True, seed=1)
    with pytest.raises(ValueError, match="rows"):
        w4a16_gemv(torch.randn(17, 64), q, s, z, 32)
    with pytest.raises(ValueError, match="plane layout"):
        w4a16_gemv(torch.randn(1, 512), q, s, z, 32)
    with pytest.raises(ValueError, match="group_size"):
        w4a16_gemv(torch.randn(1, 64), q, s, z, 48)
    with pytest.raises(ValueError, match="scales"):
        w4a16_gemv(torch.randn(1, 64), q, s.t().contiguous(), z, 32)
