"""The FP8 (e4m3) KV cache: kv_write's quantization, and the paged decode and prefill kernels reading the cache with
per-layer K and V scales, against plain-torch references that quantize and dequantize the same way
(attention/kv_quant.py). The bf16/fp16/fp32 cache paths keep their own tests (test_paged_attention.py).

Inputs are random (seeded per case) and scales are far from 1, so a kernel that skipped a scale would fail; outputs
are poisoned with NaN first so an unwritten element fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import, in case conftest was bypassed

pytest.importorskip("triton")

from flashvlm.attention.kv_quant import FP8_E4M3_MAX, FP8_KV_DTYPE, dequantize_kv, quantize_kv  # noqa: E402
from flashvlm.attention.reference import ReferenceBackend  # noqa: E402
from flashvlm.attention.triton_backend import TritonBackend  # noqa: E402
from flashvlm.kernels.kv_write import kv_write, kv_write_reference  # noqa: E402
from flashvlm.kernels.paged_decode import paged_decode, paged_decode_reference  # noqa: E402
from flashvlm.kernels.paged_prefill import paged_prefill, paged_prefill_reference  # noqa: E402
from tests.kernels.test_paged_attention import (  # noqa: E402
    BLOCK_SIZE,
    DEVICES,
    INTERPRETED,
    TOL,
    _meta,
    assert_close,
    make_block_tables,
    poisoned_like,
)

# q's dtype (the model's); the cache is e4m3 in every case. bf16 only on the GPU (the interpreter mis-handles it).
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])


def _scales(device: str, k: float = 0.037, v: float = 0.21) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([k], dtype=torch.float32, device=device),
            torch.tensor([v], dtype=torch.float32, device=device))


def make_fp8_cache(num_blocks: int, kv_heads: int, head_dim: int, device: str, gen: torch.Generator,
                   k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    """Random keys (a few large channels, as Qwen2's K bias makes them) and values, quantized with the scales."""
    k = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen) * 4
    k[..., :3] *= 3
    v = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen) * 20
    k, v = k.to(device), v.to(device)
    return torch.stack([quantize_kv(k, k_scale), quantize_kv(v, v_scale)])


def assert_close_fp8(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """Kernel and reference read the same e4m3 values; they differ only in rounding order (where the scales are
    applied) and in q's dtype, so the plain cache's tolerance holds, relative to the output's magnitude."""
    assert not out.isnan().any(), "some output elements were never written"
    tol = TOL[dtype] * max(1.0, ref.abs().max().item())
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=tol)


# ---------------------------------------------------------------- kv_write

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (3, 80)])
def test_kv_write_quantizes_as_the_reference(device: str, dtype: torch.dtype, kv_heads: int, head_dim: int) -> None:
    """Bit for bit the reference's e4m3 bytes (float32 division, saturation at +-448, round to nearest even), padding
    slots skipped, and the round trip within e4m3's half step (2^-4 relative) of what was written."""
    gen = torch.Generator().manual_seed(kv_heads * 100 + head_dim)
    num_blocks, n = 5, 19
    k_scale, v_scale = _scales(device, 0.013, 0.4)
    cache = make_fp8_cache(num_blocks, kv_heads, head_dim, device, gen, k_scale, v_scale)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:n]
    slots[[0, 11]] = -1
    slots = slots.to(device)
    packed = (torch.randn(n, 3 * kv_heads * head_dim, generator=gen) * 3).to(device=device, dtype=dtype)
    k = packed[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(n, kv_heads, head_dim)
    v = packed[:, 2 * kv_heads * head_dim:].view(n, kv_heads, head_dim)
    k[1, 0, 0], v[2, 0, 1] = 10.0, -500.0  # past 448 * scale: saturate, never NaN
    before, expected = cache.clone(), cache.clone()
    kv_write_reference(k, v, expected, slots, k_scale, v_scale)
    kv_write(k, v, cache, slots, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    keep = slots >= 0
    for half, x, scale in ((0, k, k_scale), (1, v, v_scale)):
        stored = dequantize_kv(cache[half].view(-1, kv_heads, head_dim)[slots[keep]], scale, torch.float32)
        limit = FP8_E4M3_MAX * scale
        want = x[keep].float().clamp(-limit, limit)
        # Half an e4m3 step: 2^-4 relative in the normal range, 2^-10 * scale below it (subnormals).
        torch.testing.assert_close(stored, want, rtol=2**-4, atol=2**-10 * scale.item())
    assert cache[0].view(-1, kv_heads, head_dim)[slots[1], 0, 0].float() == FP8_E4M3_MAX
    assert cache[1].view(-1, kv_heads, head_dim)[slots[2], 0, 1].float() == -FP8_E4M3_MAX


@pytest.mark.parametrize("device", DEVICES)
def test_kv_write_rounds_every_magnitude_as_torch(device: str) -> None:
    """Every finite e4m3 value, every midpoint between neighbours (ties go to even), random magnitudes from 2^-14
    to 2^11 (subnormals, normals, saturation), signed zeros and far overflow: the same bytes as torch's cast."""
    gen = torch.Generator().manual_seed(11)
    exponents = torch.randint(-14, 11, (2048,), generator=gen).float()
    spread = torch.sign(torch.randn(2048, generator=gen)) * (1 + torch.rand(2048, generator=gen)) * 2**exponents
    values = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    values = values[values.isfinite()].sort().values
    midpoints = (values[1:] + values[:-1]) / 2
    edges = torch.tensor([0.0, -0.0, 1e-9, -1e-9, 449.0, 464.0, 480.0, -500.0, 1e6])
    x = torch.cat([spread, values, midpoints, edges])
    x = torch.cat([x, torch.zeros(-x.numel() % 64)]).view(-1, 1, 64).to(device)
    cache = torch.zeros(2, (x.shape[0] + BLOCK_SIZE - 1) // BLOCK_SIZE, BLOCK_SIZE, 1, 64, dtype=FP8_KV_DTYPE,
                        device=device)
    one = torch.ones(1, device=device)
    kv_write(x, -x, cache, torch.arange(x.shape[0], device=device), one, one)
    for half, sign in ((0, 1), (1, -1)):
        stored = cache[half].view(-1, 1, 64)[: x.shape[0]]
        assert torch.equal(stored.view(torch.uint8), quantize_kv(sign * x, one).view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_scales_are_required_exactly_for_an_fp8_cache(device: str) -> None:
    k_scale, v_scale = _scales(device)
    x = torch.randn(2, 1, 16, device=device)
    slots = torch.tensor([1, 2], device=device)
    fp8 = torch.zeros(2, 2, BLOCK_SIZE, 1, 16, dtype=FP8_KV_DTYPE, device=device)
    with pytest.raises(ValueError, match="needs k_scale"):
        kv_write(x, x, fp8, slots)
    with pytest.raises(ValueError, match="1-element float32"):
        kv_write(x, x, fp8, slots, k_scale.double(), v_scale)
    with pytest.raises(ValueError, match="not a torch.float32 one"):
        kv_write(x, x, torch.zeros(2, 2, BLOCK_SIZE, 1, 16, device=device), slots, k_scale, v_scale)


# ---------------------------------------------------------------- decode

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (7, 64)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_fp8(device: str, dtype: torch.dtype, group: int, head_dim: int, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(group * 100 + head_dim + num_splits)
    kv_heads, num_blocks = 2, 12
    seq_lens = [37, 1, 70, 16]
    k_scale, v_scale = _scales(device)
    cache = make_fp8_cache(num_blocks, kv_heads, head_dim, device, gen, k_scale, v_scale)
    tables = make_block_tables(seq_lens, num_blocks, gen, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), group * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_decode(q, cache, tables, lens, scale, num_splits=num_splits, out=poisoned_like(q),
                       k_scale=k_scale, v_scale=v_scale)
    assert_close_fp8(out, paged_decode_reference(q, cache, tables, lens, scale, k_scale, v_scale), dtype)


# ---------------------------------------------------------------- prefill

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (7, 80)])  # 80: masked head-dim loads
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([30, 17], [0, 0]),
    ([1, 23, 1, 5], [45, 9, 16, 0]),
    ([9, 20], [90, 40]),
], ids=["prefill", "mixed", "long-prefix"])
def test_paged_prefill_fp8(device: str, dtype: torch.dtype, group: int, head_dim: int, q_lens: list[int],
                           ctx_lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(group * 10 + head_dim + len(q_lens))
    kv_heads = 2
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    num_blocks = sum((n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens) + 2
    k_scale, v_scale = _scales(device, 0.05, 0.09)
    cache = make_fp8_cache(num_blocks, kv_heads, head_dim, device, gen, k_scale, v_scale)
    tables = make_block_tables(seq_lens, num_blocks, gen, device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), group * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_prefill(q, cache, qsl, lens, tables, scale, max_query_len=max(q_lens), out=poisoned_like(q),
                        k_scale=k_scale, v_scale=v_scale)
    ref = paged_prefill_reference(q, cache, qsl, lens, tables, scale, k_scale, v_scale)
    assert_close_fp8(out, ref, dtype)


# ---------------------------------------------------------------- backends

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 1, 1], [30, 0, 50]), ([12, 1, 20], [0, 40, 5])],
                         ids=["decode", "mixed"])
def test_triton_backend_fp8_matches_the_reference_backend(device: str, q_lens: list[int], ctx_lens: list[int]) -> None:
    """The layer's path: write this step's K/V into an FP8 cache holding earlier tokens, then attend; the Triton
    backend's cache bytes equal the reference backend's and its output matches. Against attention over the same
    keys and values kept in float32, the FP8 cache's error stays within what e4m3's 2^-4 rounding allows, and is
    not zero (the cache really is FP8)."""
    gen = torch.Generator().manual_seed(sum(q_lens) + len(ctx_lens))
    kv_heads, heads, head_dim = 2, 8, 64
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    k_scale, v_scale = _scales(device, 0.02, 0.03)
    plain = torch.randn(2, 16, BLOCK_SIZE, kv_heads, head_dim, generator=gen).to(device) * 2
    cache = torch.stack([quantize_kv(plain[0], k_scale), quantize_kv(plain[1], v_scale)])
    tables = make_block_tables(seq_lens, 16, gen, device)
    meta = _meta(q_lens, ctx_lens, tables, device)
    n = sum(q_lens)
    q = torch.randn(n, heads, head_dim, generator=gen).to(device)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device) * 2
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device) * 2
    ref_cache = cache.clone()
    ReferenceBackend().write_kv(k, v, ref_cache, meta, k_scale, v_scale)
    TritonBackend().write_kv(k, v, cache, meta, k_scale, v_scale)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    out = TritonBackend().forward(q, cache, meta, head_dim**-0.5, k_scale, v_scale)
    expected = ReferenceBackend().forward(q, ref_cache, meta, head_dim**-0.5, k_scale, v_scale)
    assert_close(out, expected, torch.float32)
    ReferenceBackend().write_kv(k, v, plain, meta)
    unquantized = ReferenceBackend().forward(q, plain, meta, head_dim**-0.5)
    error = (out - unquantized).abs().max().item()
    assert 0 < error < 0.1 * unquantized.abs().max().item()
