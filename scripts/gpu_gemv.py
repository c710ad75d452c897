"""Decode projections at batch 1-16: cuBLAS (F.linear) against our Triton GEMV over a grid of tile
configs, at Qwen2-VL-7B's shapes (and, by name, the 4096-wide language models of the other families). Prints the
best configs per shape and their TB/s; JSON in $OUT/gemv.json.

    PYTHONPATH=. python scripts/gpu_gemv.py    # GPU only; env ROWS=1,4 (default 1,4,8,16), SHAPES=qkv,down
                                               # (default Qwen2-7B's five), GRID=default (only gemv_config's
                                               # choice) or GRID=splits (gemv_config's tiles, K split 1-4)

Timing: each variant is captured in a CUDA graph of REPEAT calls that cycle through copies of the weights
(> 200 MB in all, so no call finds its matrix in the 50 MB L2), replayed after a warm-up; per-call time is the
replay time over REPEAT. That is how the decode graph runs them: back to back, with no host in between.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import tempfile

import torch
import torch.nn.functional as F

from flashvlm.kernels.gemv import GemvConfig, gemv_config, gemv_reference, gemv_triton

OUT = os.environ.get("OUT") or tempfile.mkdtemp()
REPEAT = 24
DEFAULT_ONLY = os.environ.get("GRID") == "default"
SPLITS_ONLY = os.environ.get("GRID") == "splits"
SHAPES = {  # name: (N, K, bias)
    "qkv": (4608, 3584, True),
    "o_proj": (3584, 3584, False),
    "gate_up": (37888, 3584, False),
    "down": (3584, 18944, False),
    "lm_head": (152064, 3584, False),
}
OTHER_SHAPES = {  # Qwen3-8B (Qwen3-VL-8B), Mistral-7B (LLaVA-v1.6-Mistral-7B), Persimmon-8B (Fuyu-8B)
    "qwen3_qkv": (6144, 4096, False),
    "h4096_o_proj": (4096, 4096, False),
    "qwen3_gate_up": (24576, 4096, False),
    "qwen3_down": (4096, 12288, False),
    "mistral_gate_up": (28672, 4096, False),
    "mistral_down": (4096, 14336, False),
    "persimmon_qkv": (12288, 4096, True),
    "persimmon_up": (16384, 4096, True),
    "persimmon_down": (4096, 16384, True),
}
GRID = [GemvConfig(bn, bk, split, 4, stages) for bn, bk, split, stages in
        itertools.product((32, 64), (128, 256), (1, 2, 3, 4, 6, 8), (3, 4))] + [
        GemvConfig(16, 256, split, 4, 4) for split in (1, 2, 4)]


def graph_us(fn, copies: int) -> float:
    """Per call us of fn(i), i cycling over the weight copies, from CUDA-graph replays. With WARM_ONLY=1 in the
    environment each call runs once and nothing is timed (returns 1.0): a pass that fills Triton's kernel cache,
    run as several processes at once (one per shape) so a timing pass after it compiles nothing."""
    if os.environ.get("WARM_ONLY") == "1":
        fn(0)
        torch.cuda.synchronize()
        return 1.0
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPEAT):
            fn(i % copies)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(7):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEAT)
    return sorted(times)[len(times) // 2]


def bench_shape(name: str, n: int, k: int, has_bias: bool, rows_list: list[int], res: dict) -> None:
    copies = max(2, -(-200 * 2**20 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
    weight_bytes = n * k * 2
    locks = torch.zeros(n, dtype=torch.int32, device="cuda")
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ref = gemv_reference(x, ws[0], bias).float()
        scale = ref.abs().max().item()

        def cublas(i: int, x: torch.Tensor = x) -> torch.Tensor:
            return F.linear(x, ws[i], bias)

        def triton_gemv(i: int, cfg: GemvConfig, x: torch.Tensor = x, locks: torch.Tensor = locks) -> torch.Tensor:
            return gemv_triton(x, ws[i], bias, config=cfg, locks=locks)

        rows_out = [{"variant": "cublas", "us": graph_us(cublas, copies)}]
        if SPLITS_ONLY:
            tiles = gemv_config(n, k)
            grid = [tiles._replace(split_k=split) for split in (1, 2, 3, 4)]
        elif rows == 1 and not DEFAULT_ONLY:
            grid = GRID
        else:
            grid = [gemv_config(n, k)] + [GemvConfig(*c) for c in res.get(f"{name}/1/top", [])]
        for cfg in grid:
            try:
                err = (triton_gemv(0, cfg).float() - ref).abs().max().item()
                us = graph_us(functools.partial(triton_gemv, cfg=cfg), copies)
                # after hundreds of graph replays: counters back at zero, the answer unchanged
                err = max(err, (triton_gemv(0, cfg).float() - ref).abs().max().item())
                if locks.any():
                    raise RuntimeError("split-K counters not reset")
            except Exception as e:  # a config the compiler rejects (registers, shared memory)
                print(f"  {name} rows={rows} {cfg}: {type(e).__name__}: {str(e)[:80]}")
                continue
            rows_out.append({"variant": "triton", "config": list(cfg), "us": us, "rel_err": err / scale})
        rows_out.sort(key=lambda r: r["us"])
        base = next(r for r in rows_out if r["variant"] == "cublas")["us"]
        default = list(gemv_config(n, k))
        print(f"{name} rows={rows} N={n} K={k}: cuBLAS {base:.1f} us ({weight_bytes / base / 1e6:.2f} TB/s)")
        for r in rows_out[:5] + [r for r in rows_out if r.get("config") == default]:
            tag = "default " if r.get("config") == default else ""
            print(f"   {tag}{r['variant']} {r.get('config', '')} {r['us']:.1f} us "
                  f"({weight_bytes / r['us'] / 1e6:.2f} TB/s) err {r.get('rel_err', 0):.1e}", flush=True)
        res[f"{name}/{rows}"] = rows_out
        res[f"{name}/{rows}/top"] = [r["config"] for r in rows_out if r["variant"] == "triton"][:4]


def main() -> None:
    torch.manual_seed(0)
    rows_list = [int(r) for r in os.environ.get("ROWS", "1,4,8,16").split(",")]
    res: dict = {}
    names = os.environ.get("SHAPES", ",".join(SHAPES)).split(",")
    for name in names:
        bench_shape(name, *{**SHAPES, **OTHER_SHAPES}[name], rows_list, res)
    with open(os.path.join(OUT, "gemv.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
