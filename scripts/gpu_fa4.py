"""Is FlashAttention-4's Hopper kernel (CuTe DSL, `flash-attn-4` on PyPI) faster than cuDNN for our attention
shapes? The ViT's head dim is 80, which cuDNN pads to 128; FA4 takes 80 as it is. Also the LM's causal GQA
prefill over a fresh prompt, against SDPA and our paged kernel. Each row: its error against fp32 SDPA on the
same random inputs, its time, and whether it replays inside a CUDA graph with the same answer.

    PYTHONPATH=.:$SITE python scripts/gpu_fa4.py      # table on stdout, JSON to $OUT/fa4.json
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROWS: list[dict] = []


def first(result):
    return result[0] if isinstance(result, tuple) else result


def sdpa_ref(q, k, v, causal: bool) -> torch.Tensor:
    """fp32 SDPA on (batch, seq, heads, dim) inputs, GQA expanded."""
    groups = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.float().transpose(1, 2) for x in (q, k, v))
    if groups > 1:
        kt, vt = kt.repeat_interleave(groups, 1), vt.repeat_interleave(groups, 1)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)


def bhsd_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """SDPA on (batch, seq, heads, dim) inputs (keys/values with as many heads as the queries)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=causal).transpose(1, 2)


def lm_prefill_rows(ctx: int, new: int) -> None:
    """`new` queries after `ctx` cached keys (0: a fresh prompt), keys in a paged cache of 16-token blocks in
    random order: FA4 dense (fresh only) and paged through our backend, our Triton kernel, SDPA."""
    from flash_attn.cute.interface import flash_attn_func

    from flashvlm.attention.base import AttentionMetadata
    from flashvlm.attention.flash_attn4 import FlashAttn4Backend
    from flashvlm.attention.triton_backend import TritonBackend

    dev, dt, bs, total = "cuda", torch.bfloat16, 16, ctx + new
    q = torch.randn(1, new, 28, 128, device=dev, dtype=dt)
    k, v = (torch.randn(1, total, 4, 128, device=dev, dtype=dt) for _ in range(2))
    groups = 7
    kt, vt = (x.float().transpose(1, 2).repeat_interleave(groups, 1) for x in (k, v))
    mask = torch.arange(total, device=dev)[None, :] <= torch.arange(ctx, total, device=dev)[:, None]
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(q.float().transpose(1, 2), kt, vt, attn_mask=mask).transpose(1, 2)
    flops = 4 * 28 * 128 * new * (ctx + (new + 1) / 2)
    tag = f"prefill{new}" + (f"_after{ctx}" if ctx else "")
    if ctx == 0:
        timed(f"{tag}_fa4_dense", functools.partial(flash_attn_func, q, k, v, causal=True), ref, flops)
        qe, ke, ve = q, k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
        timed(f"{tag}_sdpa_expanded", functools.partial(bhsd_sdpa, qe, ke, ve, True), ref, flops)
    blocks = (total + bs - 1) // bs
    cache = torch.zeros(2, blocks + 1, bs, 4, 128, device=dev, dtype=dt)
    perm = torch.randperm(blocks, device=dev) + 1
    for i, x in enumerate((k, v)):
        flat = torch.zeros(blocks * bs, 4, 128, device=dev, dtype=dt)
        flat[:total] = x[0]
        cache[i, perm] = flat.view(blocks, bs, 4, 128)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, new], device=dev, dtype=torch.int32),
        seq_lens=torch.tensor([total], device=dev, dtype=torch.int32), block_tables=perm.to(torch.int32)[None],
        slot_mapping=torch.zeros(new, device=dev, dtype=torch.long), block_size=bs, query_start_loc_host=[0, new],
        seq_lens_host=[total], max_query_len=new, max_seq_len=4096)
    for backend in (FlashAttn4Backend(), TritonBackend()):
        timed(f"{tag}_{backend.name}_paged",
              functools.partial(lambda b: b.forward(q[0], cache, meta, 128**-0.5)[None], backend), ref, flops)


def timed(name: str, fn, ref: torch.Tensor, flops: float, graph: bool = True) -> None:
    row: dict = dict(op=name)
    try:
        t0 = time.perf_counter()
        out = first(fn())
        torch.cuda.synchronize()
        row["first_call_s"] = round(time.perf_counter() - t0, 2)
        row["max_err"] = (out.float() - ref).abs().max().item()
        row["us"] = triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
        row["tflops"] = flops / row["us"] / 1e6
        if graph:
            try:
                g = torch.cuda.CUDAGraph()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    first(fn())
                torch.cuda.current_stream().wait_stream(stream)
                with torch.cuda.graph(g):
                    captured = first(fn())
                g.replay()
                torch.cuda.synchronize()
                row["graph_equal"] = bool(torch.equal(captured, out))
                row["graph_us"] = triton.testing.do_bench(g.replay, warmup=20, rep=200, return_mode="median") * 1e3
            except Exception as e:
                row["graph_error"] = str(e)[:200]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    ROWS.append(row)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)


def main() -> None:
    from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func

    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    # ViT: one 1344x1344 image (9,216 patches), one 1008x756 (3,888), eight 1008x756 as varlen.
    for seq in (9216, 3888):
        q, k, v = (torch.randn(1, seq, 16, 80, device=dev, dtype=dt) for _ in range(3))
        ref = sdpa_ref(q, k, v, False)
        flops = 4 * 16 * 80 * seq * seq
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            timed(f"vit{seq}_cudnn", functools.partial(bhsd_sdpa, q, k, v), ref, flops)
        timed(f"vit{seq}_fa4", functools.partial(flash_attn_func, q, k, v), ref, flops)
    n, seq = 8, 3888
    q, k, v = (torch.randn(n * seq, 16, 80, device=dev, dtype=dt) for _ in range(3))
    cu = torch.arange(0, (n + 1) * seq, seq, device=dev, dtype=torch.int32)
    ref = sdpa_ref(*(x.view(n, seq, 16, 80) for x in (q, k, v)), False).reshape(n * seq, 16, 80)
    flops = n * 4 * 16 * 80 * seq**2
    timed("vit8x3888_fa4_varlen", functools.partial(flash_attn_varlen_func, q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                     max_seqlen_q=seq, max_seqlen_k=seq), ref, flops)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        timed("vit8x3888_cudnn", lambda: bhsd_sdpa(*(x.view(n, seq, 16, 80) for x in (q, k, v))).reshape(-1, 16, 80),
              ref, flops)
    # LM prefill, causal GQA (28 query heads over 4 KV heads, dim 128): fresh prompts of 1008x756 and 1344x1344
    # (+ 64 text tokens), and a 64-token question after a cached 1,038-token image prompt.
    for ctx, seq in ((0, 1038), (0, 2370), (1038, 64)):
        lm_prefill_rows(ctx, seq)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fa4.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
