"""FlashAttention-4 paths (optional package, Hopper/Blackwell only) against plain torch on fresh random inputs:
the LM backend over the paged cache (fresh prompts, cached prefixes, decode rows in mixed batches, graph padding,
CUDA-graph replays with new lengths), the vision tower's varlen attention, and the engine's greedy tokens.

Skipped where FA4 cannot run (CI's CPU machine); `scripts/gpu_fa4.py` and the GPU test run cover them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm.kernels.dispatch import fa4_unavailable_reason

_REASON = fa4_unavailable_reason("cuda")
if _REASON is not None:
    pytest.skip(_REASON, allow_module_level=True)

from flashvlm.attention.base import AttentionMetadata  # noqa: E402
from flashvlm.attention.flash_attn4 import FlashAttn4Backend  # noqa: E402
from flashvlm.kernels.paged_prefill import paged_prefill_reference  # noqa: E402
from flashvlm.layers.vision_attention import varlen_attention  # noqa: E402

BS = 16
"""Block size of the graph test; the backend test also takes 128, where FA4 loads whole pages by TMA."""
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _case(q_lens: list[int], ctx_lens: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
          seed: int, pad_tokens: int = 0, pad_seqs: int = 0, num_blocks: int | None = None,
          width: int | None = None, bs: int = BS,
          max_seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random queries and a random paged cache with shuffled blocks; `pad_*` adds a graph bucket's padding:
    rows past the last sequence and sequences with no queries and length 0. max_seq_len: the bound the
    metadata carries (an eager step's exact longest context by default; graphs pass max_model_len)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [a + b for a, b in zip(q_lens, ctx_lens)]
    need = [(n + bs - 1) // bs for n in seq_lens]
    num_blocks = num_blocks or sum(need) + 4
    width = width or max(need) + 2
    assert sum(need) <= num_blocks and max(need) <= width
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen).to("cuda", dtype)
    tables = torch.randint(0, num_blocks, (len(seq_lens) + pad_seqs, width), generator=gen)
    perm, used = torch.randperm(num_blocks, generator=gen), 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n]
        used += n
    n = sum(q_lens)
    qsl = [0] + np.cumsum(q_lens).tolist() + [n] * pad_seqs
    q = torch.randn(n + pad_tokens, heads, dim, generator=gen).to("cuda", dtype)

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int32, device="cuda")

    meta = AttentionMetadata(
        query_start_loc=dev(qsl), seq_lens=dev(seq_lens + [0] * pad_seqs),
        block_tables=tables.to("cuda", torch.int32), slot_mapping=torch.zeros(n, dtype=torch.long, device="cuda"),
        block_size=bs, query_start_loc_host=qsl, seq_lens_host=seq_lens + [0] * pad_seqs,
        max_query_len=max(q_lens) + pad_tokens, max_seq_len=max_seq_len or max(seq_lens))
    return q, cache, meta


def _reference(q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    n = meta.query_start_loc_host[-1]
    return paged_prefill_reference(q[:n].float(), cache.float(), meta.query_start_loc, meta.seq_lens,
                                   meta.block_tables, scale)


@pytest.fixture
def fa4_calls(monkeypatch) -> list[int]:
    """Counts the calls that reach FA4's kernel, so a test cannot pass by comparing a fallback with itself."""
    from flashvlm.attention import flash_attn4

    calls: list[int] = []
    real = flash_attn4._varlen_func()

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(flash_attn4, "_varlen_func", lambda: counted)
    return calls


@pytest.mark.parametrize("bs", [16, 128], ids=["block16", "block128-tma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(28, 4, 128), (4, 2, 64), (8, 8, 80)])
@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([300, 17], [0, 0]),  # fresh prompts, unaligned ends
    ([1, 23, 1, 130], [45, 9, 16, 0]),  # decode rows beside chunks with and without a cached prefix
    ([9, 64], [700, 333]),  # long cached prefixes
], ids=["prefill", "mixed", "long-prefix"])
def test_backend_matches_reference(fa4_calls: list[int], bs: int, dtype: torch.dtype, heads: int, kv_heads: int,
                                   dim: int, q_lens: list[int], ctx_lens: list[int]) -> None:
    q, cache, meta = _case(q_lens, ctx_lens, heads, kv_heads, dim, dtype, seed=heads + dim + len(q_lens), bs=bs)
    out = FlashAttn4Backend().forward(q, cache, meta, dim**-0.5)
    assert fa4_calls
    torch.testing.assert_close(out.float(), _reference(q, cache, meta, dim**-0.5), rtol=TOL[dtype], atol=TOL[dtype])


def test_backend_in_a_cuda_graph_with_padding_and_new_lengths() -> None:
    """Captured once for a bucket (padding rows and sequences included), replayed for other lengths written
    into the same buffers, as StepGraphs does: the real rows match the reference every time."""
    heads, kv_heads, dim, dtype = 28, 4, 128, torch.bfloat16
    tokens, seqs, blocks, width = 160, 5, 64, 24
    cases = [([40, 1, 100], [0, 57, 30]), ([7, 90, 1], [200, 0, 12]), ([1, 1, 1], [5, 300, 77])]

    def case(k: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        q_lens, ctx_lens = cases[k]
        return _case(q_lens, ctx_lens, heads, kv_heads, dim, dtype, seed=k, pad_tokens=tokens - sum(q_lens),
                     pad_seqs=seqs - len(q_lens), num_blocks=blocks, width=width, max_seq_len=4096)

    q, cache, meta = case(0)
    bucket = AttentionMetadata(query_start_loc=meta.query_start_loc.clone(), seq_lens=meta.seq_lens.clone(),
                               block_tables=meta.block_tables.clone(), slot_mapping=meta.slot_mapping, block_size=BS,
                               query_start_loc_host=[0] * (seqs + 1), seq_lens_host=[0] * seqs, max_query_len=tokens,
                               max_seq_len=4096)
    backend = FlashAttn4Backend()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, cache, bucket, dim**-0.5)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, cache, bucket, dim**-0.5)
    for k in range(len(cases)):
        qk, cache_k, m = case(k)
        for buf, value in ((q, qk), (cache, cache_k), (bucket.query_start_loc, m.query_start_loc),
                           (bucket.seq_lens, m.seq_lens), (bucket.block_tables, m.block_tables)):
            buf.copy_(value)
        graph.replay()
        n = m.query_start_loc_host[-1]
        torch.testing.assert_close(out[:n].float(), _reference(qk, cache_k, m, dim**-0.5), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cu_seqlens", [[0, 300], [0, 64, 64, 200, 456, 460], [0, 128, 256, 384]],
                         ids=["one", "mixed-and-empty", "equal"])
def test_vision_varlen_matches_sdpa(fa4_calls: list[int], dtype: torch.dtype, cu_seqlens: list[int]) -> None:
    """Head dim 80 (the Qwen2-VL ViT's), q/k/v as strided views of one packed QKV output, as the tower gives."""
    gen = torch.Generator().manual_seed(len(cu_seqlens))
    n, heads, dim = cu_seqlens[-1], 16, 80
    qkv = torch.randn(n, 3, heads, dim, generator=gen).to("cuda", dtype)
    q, k, v = qkv.unbind(1)
    out = varlen_attention(q, k, v, cu_seqlens, impl="fa4")
    assert fa4_calls == [1]
    ref = varlen_attention(q.float(), k.float(), v.float(), cu_seqlens, impl="sdpa")
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_qwen25_window_tower_matches_float32(fa4_calls: list[int], tmp_path) -> None:
    """Qwen2.5-VL's tower at head dim 80: window layers (with partial windows at the images' right and bottom
    edges) and full layers, each one FA4 varlen call, as close to the float32 SDPA tower as the bf16 SDPA tower
    is; then the engine's tokens with CUDA graphs (the LM's steps, FA4 prefill inside) equal its eager tokens."""
    import copy

    from flashvlm import LLM, SamplingParams
    from flashvlm.attention.vision import set_vision_attention
    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

    build_qwen2_vl(tmp_path, qwen25=True, seed=5, vision_width=160)
    kw = dict(device="cuda", dtype="bfloat16", kv_cache_tokens=4096, max_num_seqs=4, vision_attention="fa4")
    llm = LLM(str(tmp_path), enforce_eager=True, **kw)
    tower = llm.engine.model.visual
    assert tower.blocks[0].attn.head_dim == 80 and tower.window < 7
    grids = [(1, 10, 14), (1, 6, 4)]  # merged 5x7 and 3x2 against windows of 2x2: partial windows
    gen = torch.Generator().manual_seed(11)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), tower.in_features, generator=gen).cuda()
    with torch.inference_mode():
        reference = copy.deepcopy(tower).float()
        set_vision_attention(reference, "sdpa")
        expected = reference(pixels, grids)
        fa4 = tower(pixels, grids).float()
        assert len(fa4_calls) == len(tower.blocks)
        set_vision_attention(tower, "sdpa")
        sdpa = tower(pixels, grids).float()
    fa4_err, sdpa_err = (fa4 - expected).abs().max().item(), (sdpa - expected).abs().max().item()
    assert fa4_err <= 3 * sdpa_err + 1e-3 * expected.abs().max().item(), (fa4_err, sdpa_err)
    del llm

    rng = np.random.default_rng(1)
    prompts = [{"prompt": f"<|vision_start|><|image_pad|><|vision_end|>picture {k}",
                "images": [rng.integers(0, 256, (140, 196, 3), dtype=np.uint8)]} for k in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = {}
    for name, eager in (("eager", True), ("graphs", False)):
        llm = LLM(str(tmp_path), enforce_eager=eager, **kw)
        fa4_calls.clear()
        outs[name] = [llm.generate(p, params)[0].token_ids for p in prompts]  # one at a time: same shape
        assert fa4_calls
        assert llm.engine.runner.vision_graphs is None  # Qwen2.5's tower always runs eagerly (not graphable)
        del llm
    assert outs["graphs"] == outs["eager"]


def test_engine_tokens_match_the_reference_backend(fa4_calls: list[int]) -> None:
    """The trained demo model in bf16 (confident logits, few near-ties): FA4 for the LM's prefill and the vision
    tower, eager and with graphs (a repeated picture shape, so the tower's graph is captured and replayed), gives
    the reference backend's greedy tokens."""
    from flashvlm import LLM, SamplingParams
    from flashvlm.models.default import default_model_path

    rng = np.random.default_rng(0)
    prompts = [{"prompt": "<|vision_start|><|image_pad|><|vision_end|>" * (k % 3) + f"question {k} " * (k + 1),
                "images": [rng.integers(0, 256, (56 * (k % 4 + 1), 84, 3), dtype=np.uint8) for _ in range(k % 3)]}
               for k in range(5)]
    same_shape = [{"prompt": f"<|vision_start|><|image_pad|><|vision_end|>picture {k}",
                   "images": [rng.integers(0, 256, (112, 84, 3), dtype=np.uint8)]} for k in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for name, kw in {"reference": dict(attention_backend="reference", vision_attention="sdpa", enforce_eager=True),
                     "fa4-eager": dict(attention_backend="fa4", vision_attention="fa4", enforce_eager=True),
                     "fa4-graphs": dict(attention_backend="fa4", vision_attention="fa4")}.items():
        fa4_calls.clear()
        llm = LLM(str(default_model_path()), device="cuda", dtype="bfloat16", kv_cache_tokens=8192, max_num_seqs=8,
                  max_num_batched_tokens=256, **kw)
        assert llm.engine.runner.backend.name == kw["attention_backend"]
        outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
        outs[name] += [llm.generate(p, params)[0].token_ids for p in same_shape]  # one at a time: same shape
        assert bool(fa4_calls) == name.startswith("fa4")
        if name == "fa4-graphs":
            assert llm.engine.runner.vision_graphs is not None and llm.engine.runner.vision_graphs.num_replays > 0
        del llm
    assert outs["fa4-eager"] == outs["reference"]
    assert outs["fa4-graphs"] == outs["fa4-eager"]
