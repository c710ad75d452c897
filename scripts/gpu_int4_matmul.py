"""W4A16 products at Qwen2-7B's shapes: our Triton GEMV (decode, 1-16 rows) and GEMM (prefill) on 4-bit weights
(kernels/int4_matmul.py) against bf16 F.linear (cuBLAS) and our bf16 GEMV, each checked against the plain-torch
reference of the same weights first. Prints times and weight TB/s (packed codes + scales + zeros read per call);
JSON in $OUT/int4_matmul.json.

    PYTHONPATH=. python scripts/gpu_int4_matmul.py            # GPU; env ROWS=1,4 SHAPES=qkv,down GEMM_ROWS=512
    PYTHONPATH=. python scripts/gpu_int4_matmul.py --sweep    # also a grid of tile configs (GEMV: at the first
                                                              # row count; the next take its best 4)
    PYTHONPATH=. python scripts/gpu_int4_matmul.py --smoke    # CPU, Triton's interpreter, a tiny shape

Timing as scripts/gpu_gemv.py: CUDA graphs of back-to-back calls cycling through copies of the weights (more
than 200 MB in all, so no call finds its matrix in L2), median replay time per call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # name: (N, K, bias)
    "qkv": (4608, 3584, True),
    "o_proj": (3584, 3584, False),
    "gate_up": (37888, 3584, False),
    "down": (3584, 18944, False),
}
GROUP = 128


def make_weights(n: int, k: int, symmetric: bool, device: str, dtype: torch.dtype, seed: int):
    from flashvlm.kernels.int4_layout import pack_planes

    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, device=device, dtype=torch.uint8)
    groups = -(-k // GROUP)
    scales = (torch.rand(groups, n, generator=g, device=device) * 0.004 + 0.001).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (groups, n), generator=g, device=device, dtype=torch.uint8)
    return pack_planes(codes), scales, zeros


def weight_bytes(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None) -> int:
    return q.numel() * 4 + s.numel() * s.element_size() + (0 if z is None else z.numel())


def timer(device: str):
    if device == "cpu":
        def once(fn, copies: int) -> float:
            start = time.perf_counter()
            fn(0)
            return (time.perf_counter() - start) * 1e6
        return once
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_gemv import graph_us

    return graph_us


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)


def bench_shape(name: str, n: int, k: int, has_bias: bool, rows_list: list[int], gemm_rows: list[int],
                args: argparse.Namespace, res: dict) -> None:
    from flashvlm.kernels.gemv import gemv_triton
    from flashvlm.kernels.int4_layout import w4a16_dequantize
    from flashvlm.kernels.int4_matmul import (
        W4Config,
        gemm_config,
        gemv_config,
        w4a16_dequantize_triton,
        w4a16_gemm,
        w4a16_gemv,
    )

    device, dtype = args.device, args.dtype
    measure = timer(device)
    copies = 1 if device == "cpu" else max(2, -(-200 * 2**20 // (n * k // 2)))
    ws = [make_weights(n, k, args.symmetric, device, dtype, seed) for seed in range(copies)]
    dense_copies = 1 if device == "cpu" else max(2, -(-200 * 2**20 // (n * k * 2)))
    dense = [w4a16_dequantize(*ws[i % copies], GROUP, k, dtype) for i in range(dense_copies)]
    bias = torch.randn(n, device=device, dtype=dtype) if has_bias else None
    nbytes = weight_bytes(*ws[0])
    locks = torch.zeros(n, dtype=torch.int32, device=device)
    bad: list[str] = []

    def run(label: str, fn, ref: torch.Tensor, n_copies: int, config=None) -> dict | None:
        try:
            err = rel_err(fn(0), ref)
            us = measure(fn, n_copies)
            err = max(err, rel_err(fn(0), ref))  # after the replays: counters reset, answer unchanged
        except Exception as e:  # a config the compiler rejects (registers, shared memory)
            print(f"   {label} {config}: {type(e).__name__}: {str(e)[:100]}")
            return None
        if locks.any():
            bad.append(f"{name} {label} {config}: split-K counters not reset")
        if err > args.tolerance:
            bad.append(f"{name} {label} {config}: relative error {err:.2e}")
        return {"variant": label, "config": None if config is None else list(config), "us": us, "rel_err": err}

    for rows in rows_list + gemm_rows:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        ref = F.linear(x.float(), dense[0].float(), None if bias is None else bias.float())
        gemv = rows <= 16
        out = [run("cublas-bf16", lambda i, x=x: F.linear(x, dense[i], bias), ref, dense_copies)]
        if gemv:
            out.append(run("gemv-bf16", lambda i, x=x: gemv_triton(x, dense[i], bias, locks=locks), ref,
                           dense_copies))
        default = gemv_config(n, k) if gemv else gemm_config(rows, n)
        grid = [default]
        if args.sweep and gemv and f"{name}/top" in res:  # more rows: the best configs of the first count
            grid += [W4Config(*c) for c in res[f"{name}/top"]]
        elif args.sweep and gemv:
            grid += [W4Config(bn, split, 16, 4, stages, swap) for bn, split, stages, swap in
                     itertools.product((32, 64, 128), (1, 2, 4, 8, 16), (2, 3), (False, True))
                     if not (swap and bn < 64)]  # a swapped tile is the dot's M: 64 and up
        elif args.sweep:
            grid += [W4Config(bn, 1, bm, warps, stages) for bm, bn, warps, stages in
                     itertools.product((64, 128), (64, 128), (4, 8), (2, 3))]
        if not gemv:  # the many-row path: the weight dequantized by one launch, then cuBLAS bf16
            out.append(run("dequant+cublas", lambda i, x=x: F.linear(
                x, w4a16_dequantize_triton(*ws[i], GROUP, k, dtype), bias), ref, copies))
        for cfg in dict.fromkeys(grid):
            if gemv:
                fn = (lambda i, x=x, cfg=cfg: w4a16_gemv(x, *ws[i], GROUP, bias, config=cfg, locks=locks))
            else:
                fn = (lambda i, x=x, cfg=cfg: w4a16_gemm(x, *ws[i], GROUP, bias, config=cfg))
            out.append(run("w4a16-" + ("gemv" if gemv else "gemm"), fn, ref, copies, cfg))
        rows_out = sorted((r for r in out if r is not None), key=lambda r: r["us"])
        base = next(r["us"] for r in rows_out if r["variant"] == "cublas-bf16")
        print(f"{name} rows={rows} N={n} K={k}: cuBLAS bf16 {base:.1f} us ({n * k * 2 / base / 1e6:.2f} TB/s)")
        shown = [r for r in rows_out if r["config"] in (None, list(default))] + rows_out[:3]
        for r in dict.fromkeys(map(json.dumps, shown)):
            r = json.loads(r)
            quantized = r["variant"].startswith(("w4a16", "dequant"))
            tag = "default " if r["config"] == list(default) else ""
            tbs = (nbytes if quantized else n * k * 2) / r["us"] / 1e6
            flops = 2 * rows * n * k / r["us"] / 1e6
            print(f"   {tag}{r['variant']} {r['config'] or ''} {r['us']:.1f} us ({tbs:.2f} TB/s weights, "
                  f"{flops:.0f} TFLOP/s) err {r['rel_err']:.1e}", flush=True)
        res[f"{name}/{rows}"] = rows_out
        if gemv and f"{name}/top" not in res:
            res[f"{name}/top"] = [r["config"] for r in rows_out if r["variant"] == "w4a16-gemv"][:4]
    if bad:
        raise SystemExit("\n".join(["wrong results:", *bad]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, a tiny shape")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tile configs")
    parser.add_argument("--asymmetric", action="store_true", help="weights with zero points")
    opts = parser.parse_args()
    if opts.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    torch.manual_seed(0)
    opts.symmetric = not opts.asymmetric
    opts.device = "cpu" if opts.smoke else "cuda"
    opts.dtype = torch.float32 if opts.smoke else torch.bfloat16
    opts.tolerance = 1e-4 if opts.smoke else 2e-2
    shapes = {"tiny": (96, 640, True)} if opts.smoke else SHAPES
    names = os.environ.get("SHAPES", ",".join(shapes)).split(",")
    rows = [int(r) for r in os.environ.get("ROWS", "1,4,16").split(",")]
    gemm_rows = [int(r) for r in os.environ.get("GEMM_ROWS", "40" if opts.smoke else "64,128,512,2048").split(",")]
    res: dict = {"symmetric": opts.symmetric, "group_size": GROUP}
    for name in names:
        bench_shape(name, *shapes[name], rows, gemm_rows, opts, res)
    out = os.environ.get("OUT") or tempfile.mkdtemp()
    with open(os.path.join(out, "int4_matmul.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"results in {out}/int4_matmul.json")


if __name__ == "__main__":
    main()
