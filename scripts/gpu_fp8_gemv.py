"""FP8 decode projections at batch 1-16, Qwen2-7B's shapes: our FP8 GEMV (default config, and a grid of tile
configs at 1 row) against cuBLAS FP8 (`torch._scaled_mm`, row-wise scales, rows padded to 16), our bf16 GEMV and
cuBLAS bf16 (F.linear) in the same run. Prints per call us and TB/s of weight bytes (N*K for e4m3, 2*N*K for
bf16) with each FP8 variant's error against `fp8_gemv_reference`; JSON in $OUT/fp8_gemv.json when OUT is set.

    PYTHONPATH=. python scripts/gpu_fp8_gemv.py    # GPU; env ROWS=1,4 (default 1,4,16), SHAPES=qkv,down
                                                   # (default all four), GRID=default (only the default config)
    PYTHONPATH=. python scripts/gpu_fp8_gemv.py --smoke    # CPU, Triton's interpreter, tiny shapes (default
                                                           # ROWS=1,3 SHAPES=qkv,down, ~2 min): the script's
                                                           # own check; its times mean nothing

The whole grid compiles ~60 configs per shape: run one or two SHAPES per call to stay within 10 minutes.
Timing is scripts/gpu_gemv.py's: each variant is captured in a CUDA graph of REPEAT calls that cycle through copies
of the weights (> 200 MB in all, so no call finds its matrix in the 50 MB L2), replayed after a warm-up; per
call time is the replay time over its REPEAT (24). Variants: `fp8 default` is fp8_gemv as the layers call it (its
activation quantization included: fused up to fuse_max_rows rows, a separate launch above); `fused` and
`separate` force either; `scaled_mm` is cuBLAS alone on x already quantized, `quant+scaled_mm` adds our
quantization launch, as the prefill path runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules import Triton

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashvlm.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv_config, fp8_gemv_reference  # noqa: E402
from flashvlm.kernels.fp8_quant import quantize_fp8_per_token  # noqa: E402
from flashvlm.kernels.gemv import gemv_triton  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_gemv  # noqa: E402  (its graph timing)

DEVICE = "cpu" if SMOKE else "cuda"
REPEAT = 2
SHAPES = {  # name: (N, K, bias)
    "qkv": (4608, 3584, True),
    "o_proj": (3584, 3584, False),
    "gate_up": (37888, 3584, False),
    "down": (3584, 18944, False),
}
SMOKE_SHAPES = {"qkv": (96, 80, True), "o_proj": (48, 80, False), "gate_up": (160, 80, False),
                "down": (48, 300, False)}
GRID = (
    [Fp8GemvConfig(bn, bk, split, 4, 3, "fp8") for bn in (32, 64, 128) for bk in (256, 512) for split in (1, 2, 4)]
    + [Fp8GemvConfig(64, bk, split, 4, 3, "f16") for bk in (256, 512) for split in (1, 2)]
    + [Fp8GemvConfig(bn, 256, split, 4, 4, "fp8") for bn in (32, 64, 128) for split in (1, 2, 4)]
    + [Fp8GemvConfig(16, 512, split, 4, 3, "fp8") for split in (1, 2, 4)]
    + [Fp8GemvConfig(128, bk, split, 8, 3, "fp8") for bk in (256, 512) for split in (1, 2)]
    + [Fp8GemvConfig(bn, bk, split, 4, 3, "fma") for bn, bk in ((16, 256), (32, 256)) for split in (1, 2)]
)
SMOKE_GRID = [Fp8GemvConfig(16, 32, 2), Fp8GemvConfig(32, 64, 1, dot="f16"), Fp8GemvConfig(16, 64, 2, dot="fma")]


def graph_us(fn, copies: int) -> float:
    """Per call us of fn(i), i cycling over the weight copies: scripts/gpu_gemv.py's CUDA-graph replays (on the
    CPU: one wall-clock pass, only to run the code)."""
    if not SMOKE:
        return gpu_gemv.graph_us(fn, copies)
    start = time.perf_counter()
    for i in range(REPEAT):
        fn(i % copies)
    return (time.perf_counter() - start) * 1e6 / REPEAT


def make_weights(n: int, k: int, has_bias: bool) -> dict:
    copies = 2 if SMOKE else max(2, -(-200 * 2**20 // (n * k)))
    g = torch.Generator(device=DEVICE).manual_seed(n + k)
    w8 = [(torch.randn(n, k, device=DEVICE, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
          for _ in range(copies)]
    # bf16 copies: as many bytes past L2 with half as many matrices
    w16 = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16, generator=g) * 0.02
           for _ in range(max(2, copies // 2))]
    return {"copies": copies, "w8": w8, "w16": w16,
            "scale": torch.rand(n, device=DEVICE, generator=g) * 1e-3 + 1e-4,
            "bias": torch.randn(n, device=DEVICE, dtype=torch.bfloat16, generator=g) if has_bias else None,
            "locks": torch.zeros(-(-n // 16), dtype=torch.int32, device=DEVICE)}


def rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.float() - exact).abs().max() / exact.abs().max()).item()


def scaled_mm_variants(wt: dict, x: torch.Tensor, exact: torch.Tensor) -> dict:
    """cuBLAS FP8: x quantized per token (rows padded to 16), W as the column-major second operand."""
    m, k = x.shape
    padded = torch.ones(16, k, device=DEVICE, dtype=x.dtype)
    padded[:m] = x
    xq, xs = quantize_fp8_per_token(padded)
    scale_b = wt["scale"].view(1, -1)

    bias, tag = wt["bias"], ""
    try:
        torch._scaled_mm(xq, wt["w8"][0].t(), scale_a=xs, scale_b=scale_b, bias=bias, out_dtype=x.dtype)
    except Exception as e:  # a torch whose row-wise scaling takes no bias: time cuBLAS without it
        if bias is None:
            raise
        print(f"  scaled_mm with a bias: {type(e).__name__}: {str(e)[:100]}; timed without the bias")
        bias, tag = None, " (no bias)"
        exact = exact - wt["bias"].float()

    def mm(i: int, xq: torch.Tensor = xq, xs: torch.Tensor = xs) -> torch.Tensor:
        return torch._scaled_mm(xq, wt["w8"][i].t(), scale_a=xs, scale_b=scale_b, bias=bias, out_dtype=x.dtype)

    def quant_mm(i: int) -> torch.Tensor:
        q, s = quantize_fp8_per_token(padded)
        return mm(i, q, s)

    err = rel_err(mm(0)[:m], exact)
    return {"scaled_mm" + tag: (graph_us(mm, wt["copies"]), err),
            "quant+scaled_mm" + tag: (graph_us(quant_mm, wt["copies"]), err)}


def bench_rows(name: str, wt: dict, rows: int, grid: list[Fp8GemvConfig], res: dict) -> None:
    n, k = wt["w8"][0].shape
    copies, bias, locks = wt["copies"], wt["bias"], wt["locks"]
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    exact = fp8_gemv_reference(x.float(), wt["w8"][0], wt["scale"], None if bias is None else bias.float())
    results: dict = {}

    def run(label: str, fn, err_fn=None) -> None:
        try:
            err = err_fn() if err_fn else None
            us = graph_us(fn, copies)
            if err_fn:  # after the replays: the split-K counters back at zero, the answer unchanged
                err = max(err, err_fn())
                if locks.any():
                    raise RuntimeError("split-K counters not reset")
            results[label] = {"us": us, "rel_err": err}
        except Exception as e:  # a config the compiler rejects (registers, shared memory), an unsupported op
            print(f"  {name} rows={rows} {label}: {type(e).__name__}: {str(e)[:100]}")
            locks.zero_()

    def fp8(cfg: Fp8GemvConfig | None):
        def call(i: int) -> torch.Tensor:
            return fp8_gemv(x, wt["w8"][i], wt["scale"], bias, locks=locks, config=cfg)
        return call, lambda: rel_err(call(0), exact)

    run("cublas bf16", lambda i: F.linear(x, wt["w16"][i % len(wt["w16"])], bias))
    run("bf16 gemv", lambda i: gemv_triton(x, wt["w16"][i % len(wt["w16"])], bias, locks=locks))
    try:
        for label, (us, err) in scaled_mm_variants(wt, x, exact).items():
            results[label] = {"us": us, "rel_err": err}
    except Exception as e:
        print(f"  {name} rows={rows} scaled_mm: {type(e).__name__}: {str(e)[:100]}")
    run("fp8 default", *fp8(None))
    default = fp8_gemv_config(n, k)
    for fuse, tag in ((16, "fused"), (0, "separate")):
        run(f"fp8 default {tag}", *fp8(default._replace(fuse_max_rows=fuse)))
    tried = {}
    for cfg in grid:
        if cfg.dot == "fma" and rows > 4:
            continue
        for fuse in (16, 0) if rows > 1 else (16,):
            label = "fp8 " + ",".join(map(str, cfg[:6])) + f",fuse<={fuse}"
            tried[label] = list(cfg[:6])
            run(label, *fp8(cfg._replace(fuse_max_rows=fuse)))
    report(name, n, k, rows, results)
    res[f"{name}/{rows}"] = results
    ranked = sorted((results[label]["us"], label) for label in tried if label in results)
    res[f"{name}/{rows}/top"] = [tried[label] for _, label in ranked[:4]]


def report(name: str, n: int, k: int, rows: int, results: dict) -> None:
    print(f"{name} rows={rows} N={n} K={k}")
    fixed = ["cublas bf16", "bf16 gemv", "scaled_mm", "quant+scaled_mm", "fp8 default", "fp8 default fused",
             "fp8 default separate"]
    ranked = sorted((label for label in results if label not in fixed), key=lambda lb: results[lb]["us"])
    for label in [lb for lb in fixed if lb in results] + ranked[:5]:
        r = results[label]
        weight_bytes = n * k * (2 if "bf16" in label else 1)
        err = "" if r["rel_err"] is None else f" err {r['rel_err']:.1e}"
        print(f"   {label:44s} {r['us']:9.1f} us {weight_bytes / r['us'] / 1e6:6.2f} TB/s{err}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes (checks the script)")
    parser.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    torch.manual_seed(0)
    shapes = SMOKE_SHAPES if SMOKE else SHAPES
    rows_list = [int(r) for r in os.environ.get("ROWS", "1,3" if SMOKE else "1,4,16").split(",")]
    grid = [] if os.environ.get("GRID") == "default" else SMOKE_GRID if SMOKE else GRID
    res: dict = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in os.environ.get("SHAPES", "qkv,down" if SMOKE else ",".join(shapes)).split(","):
        n, k, has_bias = shapes[name]
        wt = make_weights(n, k, has_bias)
        for rows in rows_list:  # the grid at 1 row; more rows try its four best (with x fused and separate)
            top = [Fp8GemvConfig(*c) for c in res.get(f"{name}/1/top", [])]
            bench_rows(name, wt, rows, grid if rows == 1 else top, res)
        del wt
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_gemv.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
