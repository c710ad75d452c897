"""Paged-attention kernels (kv_write, split-K decode, varlen prefill) and TritonBackend against plain torch.

On CPU the kernels run under Triton's interpreter (tests/kernels/conftest.py sets TRITON_INTERPRET=1 when there
is no GPU); on a GPU machine the same tests run the compiled kernels on CUDA, adding fp16/bf16 cases.
Inputs are random (seeded per case); outputs are poisoned with NaN first so an unwritten element fails.
"""

from __future__ import annotations

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import, in case conftest was bypassed

pytest.importorskip("triton")

from flashvlm.attention.base import AttentionMetadata, get_backend, write_key_bias  # noqa: E402
from flashvlm.attention.reference import ReferenceBackend  # noqa: E402
from flashvlm.attention.triton_backend import TritonBackend  # noqa: E402
from flashvlm.kernels import paged_decode as decode_mod  # noqa: E402
from flashvlm.kernels.kv_write import kv_write, kv_write_reference  # noqa: E402
from flashvlm.kernels.paged_decode import choose_num_splits, paged_decode, paged_decode_reference  # noqa: E402
from flashvlm.kernels.paged_prefill import paged_prefill, paged_prefill_reference  # noqa: E402

INTERPRETED = type(decode_mod._decode_split_kernel).__name__ == "InterpretedFunction"
if INTERPRETED:
    DEVICES = ["cpu"]  # the interpreter would also take CUDA tensors, but slowly and without testing codegen
elif torch.cuda.is_available():
    DEVICES = ["cuda"]
else:
    DEVICES = []
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set and there is no GPU",
                allow_module_level=True)

# The interpreter mis-handles bf16 (numpy has no bf16), so bf16 runs only on the GPU.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRETED else [torch.bfloat16])
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
BLOCK_SIZE = 16


def make_cache(num_blocks: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
               gen: torch.Generator, page: int = BLOCK_SIZE) -> torch.Tensor:
    return torch.randn(2, num_blocks, page, kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)


def make_block_tables(seq_lens: list[int], num_blocks: int, gen: torch.Generator, device: str,
                      page: int = BLOCK_SIZE) -> torch.Tensor:
    """Disjoint, shuffled (non-contiguous) pages per sequence; unused entries hold other valid page ids, so a
    kernel that reads past a sequence's last page picks up wrong data instead of a lucky zero."""
    need = [(n + page - 1) // page for n in seq_lens]
    width = max(max(need), 1) + 2
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), width), generator=gen)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    return table.to(device=device, dtype=torch.int32)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any(), "some output elements were never written"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


# ---------------------------------------------------------------- kv_write

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (4, 128), (3, 80)])
def test_kv_write_skips_padding_slots(device: str, dtype: torch.dtype, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(kv_heads * 1000 + head_dim)
    num_blocks, n = 6, 21
    cache = make_cache(num_blocks, kv_heads, head_dim, dtype, device, gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:n]
    slots[[0, 7, 20]] = -1  # padding rows of a graph-padded batch
    slots = slots.to(device)
    # k and v as strided views into one packed projection output, in fp32, cast by the kernel to the cache dtype.
    packed = torch.randn(n, 3 * kv_heads * head_dim, generator=gen).to(device)
    k = packed[:, kv_heads * head_dim: 2 * kv_heads * head_dim].view(n, kv_heads, head_dim)
    v = packed[:, 2 * kv_heads * head_dim:].view(n, kv_heads, head_dim)
    before = cache.clone()
    expected = cache.clone()
    kv_write_reference(k, v, expected, slots)
    kv_write(k, v, cache, slots)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    assert not torch.equal(cache, before)


# ---------------------------------------------------------------- decode

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (7, 128), (7, 64)])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.slow
def test_paged_decode(device: str, dtype: torch.dtype, group: int, head_dim: int, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(group * 100 + head_dim + num_splits)
    kv_heads = 2
    seq_lens = [37, 1, 83, 16]  # unaligned, a single token, several splits' worth, exactly one page
    num_blocks = 16
    cache = make_cache(num_blocks, kv_heads, head_dim, dtype, device, gen)
    tables = make_block_tables(seq_lens, num_blocks, gen, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), group * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_decode(q, cache, tables, lens, scale, num_splits=num_splits, out=poisoned_like(q))
    assert_close(out, paged_decode_reference(q, cache, tables, lens, scale), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_padding_rows_and_small_tiles(device: str, num_splits: int) -> None:
    """seq_len 0 rows (CUDA-graph padding) give zeros, not NaN; BLOCK_N smaller than a page and more splits than
    the context has tokens still cover every key exactly once."""
    gen = torch.Generator().manual_seed(7 + num_splits)
    kv_heads, group, head_dim = 1, 4, 64
    seq_lens = [0, 3, 50, 0]
    # Pages of 32 tokens read in tiles of 16 (the smallest tile tl.dot compiles on a GPU).
    cache = make_cache(8, kv_heads, head_dim, torch.float32, device, gen, page=32)
    tables = make_block_tables(seq_lens, 8, gen, device, page=32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(4, group * kv_heads, head_dim, generator=gen).to(device)
    ref = paged_decode_reference(q, cache, tables, lens, 0.3)
    out = paged_decode(q, cache, tables, lens, 0.3, num_splits=num_splits, out=poisoned_like(q), block_n=16)
    assert_close(out, ref, torch.float32)
    assert (out[0] == 0).all() and (out[3] == 0).all()


def test_choose_num_splits() -> None:
    assert choose_num_splits(1, 4, 4096) == 32  # 4096 / 128-token splits (2 waves would allow 66)
    assert choose_num_splits(1, 4, 200) == 2  # no split under 128 tokens
    assert choose_num_splits(256, 4, 4096) == 1  # batch alone fills the GPU
    assert choose_num_splits(1, 1, 10**6) == 64  # capped


# ---------------------------------------------------------------- prefill

def _prefill_case(q_lens: list[int], ctx_lens: list[int], group: int, head_dim: int, dtype: torch.dtype,
                  device: str, seed: int, kv_heads: int = 2) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    num_blocks = sum((n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in seq_lens) + 3
    cache = make_cache(num_blocks, kv_heads, head_dim, dtype, device, gen)
    tables = make_block_tables(seq_lens, num_blocks, gen, device)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), group * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, cache, qsl, lens, tables


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (7, 128), (7, 80)])  # 80: masked head-dim loads
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([40, 17], [0, 0]),  # plain prefill, unaligned chunk ends
    ([1, 23, 1, 5], [45, 9, 16, 0]),  # mixed: decode tokens beside chunks with and without a cached prefix
    ([9, 30], [150, 70]),  # long prefixes: several unmasked key tiles before the diagonal ones
], ids=["prefill", "mixed", "long-prefix"])
@pytest.mark.slow
def test_paged_prefill(device: str, dtype: torch.dtype, group: int, head_dim: int, q_lens: list[int],
                       ctx_lens: list[int]) -> None:
    q, cache, qsl, lens, tables = _prefill_case(q_lens, ctx_lens, group, head_dim, dtype, device,
                                                seed=group * 10 + head_dim + len(q_lens))
    scale = head_dim**-0.5
    out = paged_prefill(q, cache, qsl, lens, tables, scale, max_query_len=max(q_lens), out=poisoned_like(q))
    assert_close(out, paged_prefill_reference(q, cache, qsl, lens, tables, scale), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_paged_prefill_random_chunks_and_tiles(device: str, block_m: int) -> None:
    """Random chunk lengths 1..40 after random prefixes, empty chunks among them, and several tile shapes, so the
    binary search from tile to sequence meets tiles that straddle sequence boundaries."""
    gen = torch.Generator().manual_seed(block_m)
    q_lens = torch.randint(1, 41, (5,), generator=gen).tolist() + [0]
    ctx_lens = torch.randint(0, 40, (6,), generator=gen).tolist()
    q, cache, qsl, lens, tables = _prefill_case(q_lens, ctx_lens, 7, 64, torch.float32, device, seed=block_m,
                                                kv_heads=1)
    out = paged_prefill(q, cache, qsl, lens, tables, 0.2, max_query_len=max(q_lens), out=poisoned_like(q),
                        block_m=block_m, block_n=16)
    assert_close(out, paged_prefill_reference(q, cache, qsl, lens, tables, 0.2), torch.float32)


# ---------------------------------------------------------------- backend

def _meta(q_lens: list[int], ctx_lens: list[int], tables: torch.Tensor, device: str) -> AttentionMetadata:
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    qsl = [0] + torch.tensor(q_lens).cumsum(0).tolist()
    slots = []
    for i, (a, b) in enumerate(zip(ctx_lens, seq_lens)):
        pos = torch.arange(a, b)
        slots.append(tables[i].cpu().long()[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    slot_mapping = torch.cat(slots)

    def dev(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype, device=device)

    return AttentionMetadata(
        query_start_loc=dev(qsl, torch.int32), seq_lens=dev(seq_lens, torch.int32),
        block_tables=tables, slot_mapping=slot_mapping.to(device),
        block_size=BLOCK_SIZE, query_start_loc_host=qsl, seq_lens_host=seq_lens, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 1, 1], [30, 0, 64]), ([12, 1, 30], [0, 40, 5])],
                         ids=["decode", "mixed"])
@pytest.mark.parametrize("bound", [None, 2048], ids=["splits-from-batch", "splits-from-bound"])
def test_triton_backend_matches_reference(device: str, q_lens: list[int], ctx_lens: list[int],
                                          bound: int | None) -> None:
    gen = torch.Generator().manual_seed(sum(q_lens))
    kv_heads, heads, head_dim = 2, 14, 64
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    cache = make_cache(20, kv_heads, head_dim, torch.float32, device, gen)
    tables = make_block_tables(seq_lens, 20, gen, device)
    meta = _meta(q_lens, ctx_lens, tables, device)
    n = sum(q_lens)
    # q, k, v as views into one packed QKV output, as the model layer hands them over.
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device)
    q = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(n, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(n, kv_heads, head_dim)
    ref_backend = ReferenceBackend()
    backend = get_backend("triton") if bound is None else TritonBackend(max_seq_len_bound=bound)
    ref_cache = cache.clone()
    ref_backend.write_kv(k, v, ref_cache, meta)
    backend.write_kv(k, v, cache, meta)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    out = backend.forward(q, cache, meta, head_dim**-0.5)
    assert_close(out, ref_backend.forward(q, ref_cache, meta, head_dim**-0.5), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_fa4_backend_keeps_our_kernel_where_fa4_does_not_take_the_inputs(device: str) -> None:
    """float32 (and CPU) inputs never reach FlashAttention-4: the fa4 backend gives the Triton backend's answer,
    for a mixed prefill/decode step and a pure-decode one."""
    from flashvlm.attention.flash_attn4 import FlashAttn4Backend

    gen = torch.Generator().manual_seed(3)
    for q_lens, ctx_lens in (([12, 1, 30], [0, 40, 5]), ([1, 1], [17, 3])):
        seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
        cache = make_cache(20, 2, 64, torch.float32, device, gen)
        meta = _meta(q_lens, ctx_lens, make_block_tables(seq_lens, 20, gen, device), device)
        q = torch.randn(sum(q_lens), 8, 64, generator=gen).to(device)
        expected = TritonBackend().forward(q, cache, meta, 0.125)
        torch.testing.assert_close(FlashAttn4Backend().forward(q, cache, meta, 0.125), expected, rtol=0, atol=0)


# ---------------------------------------------------------------- per-slot key bias (proportional attention)

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_adds_the_key_bias_by_slot(device: str, dtype: torch.dtype, num_splits: int) -> None:
    gen = torch.Generator().manual_seed(11 + num_splits)
    kv_heads, group, head_dim, num_blocks = 2, 4, 64, 16
    seq_lens = [37, 1, 83, 16]
    cache = make_cache(num_blocks, kv_heads, head_dim, dtype, device, gen)
    tables = make_block_tables(seq_lens, num_blocks, gen, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(len(seq_lens), group * kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    bias = (torch.rand(num_blocks * BLOCK_SIZE, generator=gen) * 3).log1p().to(device)  # log-counts-like, >= 0
    out = paged_decode(q, cache, tables, lens, 0.125, num_splits=num_splits, out=poisoned_like(q), key_bias=bias)
    ref = paged_decode_reference(q, cache, tables, lens, 0.125, key_bias=bias)
    assert_close(out, ref, dtype)
    assert (ref - paged_decode_reference(q, cache, tables, lens, 0.125)).abs().max() > 1e-2  # the bias mattered
    zero = paged_decode(q, cache, tables, lens, 0.125, num_splits=num_splits, key_bias=torch.zeros_like(bias))
    assert torch.equal(zero, paged_decode(q, cache, tables, lens, 0.125, num_splits=num_splits))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,ctx_lens", [([40, 17], [0, 0]), ([1, 23, 1, 5], [45, 9, 16, 0]), ([9, 30], [150, 70])],
                         ids=["prefill", "mixed", "long-prefix"])
def test_paged_prefill_adds_the_key_bias_by_slot(device: str, dtype: torch.dtype, q_lens: list[int],
                                                 ctx_lens: list[int]) -> None:
    q, cache, qsl, lens, tables = _prefill_case(q_lens, ctx_lens, 4, 64, dtype, device, seed=5 + len(q_lens))
    gen = torch.Generator().manual_seed(len(q_lens))
    bias = (torch.rand(cache.shape[1] * BLOCK_SIZE, generator=gen) * 3).log1p().to(device)
    out = paged_prefill(q, cache, qsl, lens, tables, 0.125, max_query_len=max(q_lens), out=poisoned_like(q),
                        key_bias=bias)
    ref = paged_prefill_reference(q, cache, qsl, lens, tables, 0.125, key_bias=bias)
    assert_close(out, ref, dtype)
    assert (ref - paged_prefill_reference(q, cache, qsl, lens, tables, 0.125)).abs().max() > 1e-2
    plain = paged_prefill(q, cache, qsl, lens, tables, 0.125, max_query_len=max(q_lens))
    zero = paged_prefill(q, cache, qsl, lens, tables, 0.125, max_query_len=max(q_lens),
                         key_bias=torch.zeros_like(bias))
    assert torch.equal(zero, plain)  # a zero bias is the unbiased kernel's answer, bit for bit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_lens,ctx_lens", [([1, 1, 1], [30, 0, 64]), ([12, 1, 30], [0, 40, 5])],
                         ids=["decode", "mixed"])
def test_backends_write_and_read_the_key_bias_alike(device: str, q_lens: list[int], ctx_lens: list[int]) -> None:
    """The step's new keys' bias lands in their slots and both backends read it; the fa4 backend takes our kernel
    for a biased step."""
    from flashvlm.attention.flash_attn4 import FlashAttn4Backend

    gen = torch.Generator().manual_seed(17 + sum(q_lens))
    kv_heads, heads, head_dim, num_blocks = 2, 8, 64, 20
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    cache = make_cache(num_blocks, kv_heads, head_dim, torch.float32, device, gen)
    tables = make_block_tables(seq_lens, num_blocks, gen, device)
    n = sum(q_lens)
    stored = (torch.rand(num_blocks * BLOCK_SIZE, generator=gen) * 2).log1p().to(device)
    new = (torch.rand(n, generator=gen) * 2).log1p().to(device)
    meta = _meta(q_lens, ctx_lens, tables, device)
    q = torch.randn(n, heads, head_dim, generator=gen).to(device)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device)
    outs = []
    for backend in (ReferenceBackend(), TritonBackend(), FlashAttn4Backend()):
        slot_bias = stored.clone()
        biased = AttentionMetadata.of(meta, slot_bias=slot_bias)
        kv = cache.clone()
        backend.write_kv(k, v, kv, biased)
        write_key_bias(slot_bias, meta.slot_mapping, new)
        assert torch.equal(slot_bias[meta.slot_mapping], new)
        outs.append(backend.forward(q, kv, biased, head_dim**-0.5))
    assert_close(outs[1], outs[0], torch.float32)
    torch.testing.assert_close(outs[2], outs[1], rtol=0, atol=0)
