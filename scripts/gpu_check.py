"""GPU correctness and kernel timing for the fast path. Prints a short table; JSON under $OUT.

    PYTHONPATH=. python scripts/gpu_check.py            # PARITY_MODEL=DIR: that checkpoint instead of the demo
    STAGES=kernels PYTHONPATH=. python scripts/gpu_check.py   # only the kernel timings

1. A random tiny Qwen2-VL and the trained demo model, each in fp32 and bf16: greedy tokens of the Triton path
   (attention + fused kernels) against the reference path (torch attention + torch ops), and graphs against
   eager, for 64 tokens over several prompts with images.
2. Kernel timings at Qwen2-VL-7B shapes against the floor (bytes over 4.2 TB/s), as CUDA-graph replays
   (do_bench_cudagraph): a Triton launch from Python costs 40-80 us on the H200's host, more than many of these
   kernels take, so plain do_bench timed the host. The ViT attention rows (200+ us, torch SDPA) use do_bench.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

import numpy as np
import torch
import triton.testing

from flashvlm import LLM, SamplingParams
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

OUT = os.environ.get("OUT") or tempfile.mkdtemp()
RES: dict = {}


CONFIGS = {"reference": dict(attention_backend="reference", vision_attention="sdpa", kernel_backend="torch",
                             enforce_eager=True),
           "triton-eager": dict(attention_backend="triton", vision_attention="sdpa", kernel_backend="triton",
                                enforce_eager=True),
           "triton-graphs": dict(attention_backend="triton", vision_attention="sdpa", kernel_backend="triton")}
if os.environ.get("PARITY_FA4"):  # FlashAttention-4 for the LM's prefill and the tower (bf16/fp16 only)
    CONFIGS.update({"fa4-eager": dict(attention_backend="fa4", vision_attention="fa4", enforce_eager=True),
                    "fa4-graphs": dict(attention_backend="fa4", vision_attention="fa4")})


def parity() -> None:
    rng = np.random.default_rng(0)
    prompts = [{"prompt": "<|vision_start|><|image_pad|><|vision_end|>" * (k % 3) + f"question {k} " * (k + 1),
                "images": [rng.integers(0, 256, (56 * (k % 4 + 1), 84, 3), dtype=np.uint8) for _ in range(k % 3)]}
               for k in range(5)]  # 5 requests: the graph pads the batch to 8
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    # A random tiny model, and the trained demo model, whose confident logits leave few near-ties for bf16
    # rounding to flip (PARITY_MODEL=path: that checkpoint instead of the demo).
    from flashvlm.models.default import default_model_path

    trained = os.environ.get("PARITY_MODEL") or str(default_model_path())
    for label, model in (("random", None), ("demo", trained)):
        for dtype in ("float32", "bfloat16"):
            path = model or str(build_qwen2_vl(tempfile.mkdtemp(), seed=9, dtype=getattr(torch, dtype)))
            outs, first_logits = {}, {}
            for name, kw in CONFIGS.items():
                if name.startswith("fa4") and dtype == "float32":
                    continue
                llm = LLM(path, device="cuda", dtype=dtype, kv_cache_tokens=16384, max_num_seqs=8, **kw)
                # Tokens first, without recording logits: graphs then run the greedy decode lookahead too.
                outs[name] = [o.token_ids for o in llm.generate(prompts, params)]
                llm.engine.runner.record_logits = True
                first = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
                first_logits[name] = torch.stack([llm.engine.runner.recorded_logits[o.request_id][0] for o in first])
                if name == "triton-graphs" and llm.engine.runner.pipeline is not None:
                    p = llm.engine.runner.pipeline
                    RES[f"{label}:{dtype}:lookaheads"] = dict(launched=p.num_lookaheads, dropped=p.num_dropped)
                del llm
            for name, base in (("triton-eager", "reference"), ("triton-graphs", "triton-eager"),
                               ("fa4-eager", "reference"), ("fa4-graphs", "fa4-eager")):
                if name not in outs:
                    continue
                ref = outs[base]
                same = sum(a == b for a, b in zip(ref, outs[name]))
                agree = float(np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(ref, outs[name])]))
                diff = (first_logits[name] - first_logits["reference"]).abs().max().item()
                key = f"{label}:{dtype}:{name}_vs_{base}"
                RES[key] = dict(identical=f"{same}/{len(prompts)}", token_agreement=agree, first_logits_maxdiff=diff)
                print(key, RES[key], RES.get(f"{label}:{dtype}:lookaheads", ""), flush=True)


def kernel_timings() -> None:
    from flashvlm.attention.base import AttentionMetadata  # noqa: F401
    from flashvlm.kernels.paged_decode import choose_num_splits, paged_decode

    heads, kv_heads, dim, bs = 28, 4, 128, 16
    rows = []
    for batch, seq in [(1, 1100), (16, 1100), (64, 1100), (1, 4096)]:
        blocks_per = (seq + bs - 1) // bs
        num_blocks = batch * blocks_per + 1
        cache = torch.randn(2, num_blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * blocks_per].view(batch, blocks_per) + 1
        tables = tables.int()
        lens = torch.full((batch,), seq, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        splits = choose_num_splits(batch, kv_heads, seq)
        ms = triton.testing.do_bench_cudagraph(
            lambda q=q, cache=cache, tables=tables, lens=lens, splits=splits: paged_decode(
                q, cache, tables, lens, dim ** -0.5, num_splits=splits), return_mode="median")
        kv_bytes = 2 * batch * seq * kv_heads * dim * 2
        rows.append(dict(op="decode", batch=batch, seq=seq, splits=splits, us=ms * 1e3,
                         floor_us=kv_bytes / 4.2e12 * 1e6))
    for part in (vision_timings, prefill_timings):
        try:  # one part failing still prints the others
            rows += part()
        except Exception:
            import traceback

            traceback.print_exc()
    RES["kernels"] = rows
    print(f"{'op':22} {'batch':>5} {'seq':>5} {'splits':>6} {'us':>9} {'floor us':>9} {'max err':>8}")
    for r in rows:
        print(f"{r['op']:22} {r['batch']:5} {r['seq']:5} {r['splits']:6} {r['us']:9.1f} {r['floor_us']:9.1f} "
              f"{r.get('max_err', 0):8.3g}")


def prefill_timings() -> list[dict]:
    """Paged prefill attention for one fresh prompt (1008x756 and 1344x1344 + 64 tokens) per tile config, with
    its largest difference from causal SDPA in fp32, and SDPA's own time."""
    from flashvlm.kernels.paged_prefill import paged_prefill, prefill_tiles

    heads, kv_heads, dim, bs = 28, 4, 128, 16
    rows = []
    configs = [None, (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
               (128, 32, 4, 3), (64, 64, 4, 3)]
    for n in (1038, 2370):
        blocks = (n + bs - 1) // bs
        cache = torch.randn(2, blocks + 1, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        tables = (torch.randperm(blocks, device="cuda").to(torch.int32) + 1)[None]
        q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        lens = torch.tensor([n], device="cuda", dtype=torch.int32)
        k_dense = cache[0, tables[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None].repeat_interleave(7, 1)
        v_dense = cache[1, tables[0].long()].flatten(0, 1)[:n].transpose(0, 1)[None].repeat_interleave(7, 1)
        qq = q.transpose(0, 1)[None]
        ref = torch.nn.functional.scaled_dot_product_attention(qq.float(), k_dense.float(), v_dense.float(),
                                                               is_causal=True)[0].transpose(0, 1)
        flops = 4 * heads * dim * n * (n + 1) / 2
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, qq, k_dense, v_dense, is_causal=True)
        ms = triton.testing.do_bench_cudagraph(sdpa, return_mode="median")
        rows.append(dict(op="sdpa_causal_ref", batch=1, seq=n, splits=0, us=ms * 1e3, floor_us=flops / 790e12 * 1e6))
        for cfg in configs:
            tiles = dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg)) if cfg else {}
            run = functools.partial(paged_prefill, q, cache, qsl, lens, tables, dim ** -0.5, max_query_len=n, **tiles)
            try:
                err = (run().float() - ref).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(run, return_mode="median")
            except Exception as e:
                print(f"prefill {cfg}: {str(e)[:80]}")
                continue
            name = "x".join(map(str, cfg or prefill_tiles(n, 7, torch.bfloat16)))
            rows.append(dict(op=f"prefill_{'auto' if cfg is None else ''}{name}", batch=1, seq=n, splits=0,
                             us=ms * 1e3, floor_us=flops / 790e12 * 1e6, max_err=err))
    return rows


def vision_timings() -> list[dict]:
    """The ViT's attention for one 1008x756 image (3,888 patches, 16 heads of 80) under each SDPA backend (head
    dim 80 suits some better than others), and quick_gelu fused vs torch's three ops on its MLP activation."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashvlm.kernels.activation import quick_gelu_triton
    from flashvlm.layers.activation import quick_gelu_reference

    rows = []
    heads, dim = 16, 80
    n = 3888
    # Head dim 80 zero-padded to 96 or 128 takes cuDNN the same time (it pads to 128 itself); flash is slower.
    for seq in (3888, 9216):
        flops = 4 * heads * dim * seq * seq
        q, k, v = (torch.randn(1, heads, seq, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    ms = triton.testing.do_bench(functools.partial(torch.nn.functional.scaled_dot_product_attention,
                                                                   q, k, v), return_mode="median")
            except RuntimeError as e:  # a backend that does not take these shapes
                print(f"vit attention {backend.name}: {str(e)[:80]}")
                continue
            rows.append(dict(op=f"vit_{backend.name.lower()[:5]}_d{dim}", batch=1, seq=seq, splits=0,
                             us=ms * 1e3, floor_us=flops / 790e12 * 1e6))
    x = torch.randn(n, 5120, device="cuda", dtype=torch.bfloat16)
    for name, fn in (("quick_gelu_torch", quick_gelu_reference), ("quick_gelu_fused", quick_gelu_triton)):
        ms = triton.testing.do_bench_cudagraph(lambda fn=fn: fn(x), return_mode="median")
        rows.append(dict(op=name, batch=1, seq=n, splits=0, us=ms * 1e3, floor_us=2 * x.numel() * 2 / 4.2e12 * 1e6))
    from flashvlm.kernels.norm import layernorm_triton
    from flashvlm.layers.norm import layer_norm_reference

    h, r, w, b = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for shape in ((n, 1280), (n, 1280),
                                                                                         (1280,), (1280,)))
    for name, fn in (("add_layernorm_torch", layer_norm_reference), ("add_layernorm_fused", layernorm_triton)):
        # As graph replays: a kernel this short takes less time than its Python launch, which do_bench would time.
        ms = triton.testing.do_bench_cudagraph(functools.partial(fn, h, r, w, b, 1e-6), return_mode="median")
        rows.append(dict(op=name, batch=1, seq=n, splits=0, us=ms * 1e3, floor_us=4 * h.numel() * 2 / 4.2e12 * 1e6))
    return rows


if __name__ == "__main__":
    import traceback

    stages = {"parity": parity, "kernels": kernel_timings}
    for name in os.environ.get("STAGES", "parity,kernels").split(","):
        stage = stages[name]
        try:
            stage()
        except Exception:
            RES.setdefault("errors", []).append(traceback.format_exc()[-3000:])
            traceback.print_exc()
    with open(os.path.join(OUT, "gpu_check.json"), "w") as f:
        json.dump(RES, f, indent=1)
