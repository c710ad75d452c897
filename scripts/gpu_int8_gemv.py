"""INT8 W8A8 decode products at Qwen2-7B's shapes: our Triton GEMV (x quantized inside it, or by quantize_rows
first), torch._int_mm (cuBLAS int8, rows padded to 17) and bf16 (F.linear and our bf16 GEMV) in one run.
Correctness first: every int8 variant is checked against w8a8_reference before it is timed, and a variant that
disagrees is reported, not timed. Weight TB/s counts the int8 matrix (N * K bytes; bf16: 2 * N * K).

    PYTHONPATH=. python scripts/gpu_int8_gemv.py            # GPU; env ROWS=1,4,16  SHAPES=qkv,down  GRID=1
                                                           # (GRID=1: also time a grid of GEMV tile configs)
    PYTHONPATH=. python scripts/gpu_int8_gemv.py --smoke    # CPU, Triton's interpreter, one tiny shape

JSON in $OUT/int8_gemv.json. Timing as scripts/gpu_gemv.py: CUDA graphs of back-to-back calls over copies of
the weights that do not fit in L2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flashvlm.kernels.gemv import gemv_triton  # noqa: E402
from flashvlm.kernels.int8_gemv import (  # noqa: E402
    Int8GemvConfig,
    dequantize_product_triton,
    int8_gemv_config,
    quantize_rows,
    w8a8_gemv,
)
from flashvlm.kernels.int8_torch import int_mm_w8a8, quantize_weight_per_channel, w8a8_reference  # noqa: E402

OUT = os.environ.get("OUT") or tempfile.mkdtemp()
SHAPES = {  # name: (N, K, bias)
    "qkv": (4608, 3584, True),
    "o_proj": (3584, 3584, False),
    "gate_up": (37888, 3584, False),
    "down": (3584, 18944, False),
}
SMOKE_SHAPES = {"tiny": (96, 320, True)}
GRID = [Int8GemvConfig(bn, bk, split, 4, stages) for bn, bk, split, stages in
        itertools.product((32, 64, 128), (128, 256, 512), (1, 2, 4), (3, 4))]
MAX_REL_ERR = 2e-2
"""bf16 output rounding plus rare one-step flips of a quantized activation (tests/kernels/test_int8_gemv.py)."""


def time_us(fn: Callable[[int], torch.Tensor], copies: int) -> float:
    if SMOKE:  # the interpreter: wall time of one call, only to show the script runs end to end
        start = time.perf_counter()
        fn(0)
        return (time.perf_counter() - start) * 1e6
    from gpu_gemv import graph_us  # scripts/ is on sys.path: the script's own folder

    return graph_us(fn, copies)


def bench_shape(name: str, n: int, k: int, has_bias: bool, rows_list: list[int], grid: bool,
                device: str, dtype: torch.dtype) -> list[dict]:
    copies = 1 if SMOKE else max(2, -(-200 * 2**20 // (n * k)))
    w_float = [torch.randn(n, k, device=device) * 0.02 for _ in range(min(copies, 2))]
    quantized = [quantize_weight_per_channel(w) for w in w_float]
    ws = [quantized[i % len(quantized)][0].clone() for i in range(copies)]
    scales = [quantized[i % len(quantized)][1].contiguous() for i in range(copies)]
    copies_b = 1 if SMOKE else max(2, -(-200 * 2**20 // (2 * n * k)))
    wb = [w_float[i % len(w_float)].to(dtype) for i in range(copies_b)]
    bias = torch.randn(n, device=device, dtype=dtype) if has_bias else None
    locks = torch.zeros(n, dtype=torch.int32, device=device)
    results = []
    for rows in rows_list:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        ref = w8a8_reference(x, ws[0], scales[0], bias).float()
        ref_scale = ref.abs().max().item()
        def two_kernels(i: int, x: torch.Tensor = x) -> torch.Tensor:
            q, s = quantize_rows(x)
            return w8a8_gemv(q, ws[i], scales[i], bias, x_scale=s, out_dtype=x.dtype, locks=locks)

        variants: dict[str, Callable[[int], torch.Tensor]] = {
            "int8 gemv, quantize fused": lambda i, x=x: w8a8_gemv(x, ws[i], scales[i], bias, locks=locks),
            "int8 gemv after quantize_rows": two_kernels,
            "int8 _int_mm": lambda i, x=x: int_mm_w8a8(x, ws[i], scales[i], bias, quantize=quantize_rows,
                                                        epilogue=dequantize_product_triton),
        }
        if grid:
            for cfg in GRID:
                variants[f"grid {tuple(cfg)}"] = (
                    lambda i, cfg=cfg, x=x: w8a8_gemv(x, ws[i], scales[i], bias, config=cfg, locks=locks))
        for label, fn in variants.items():
            results.append(_measure(name, rows, label, fn, copies, ref, ref_scale, n * k, locks))
        for label, fn in {"bf16 F.linear": lambda i, x=x: F.linear(x, wb[i], bias),
                          "bf16 gemv": lambda i, x=x: gemv_triton(x, wb[i], bias, locks=locks)}.items():
            if SMOKE and label == "bf16 gemv":
                continue  # the bf16 GEMV has its own interpreter tests; fp32 here would only repeat them
            results.append(_measure(name, rows, label, fn, len(wb), None, ref_scale, 2 * n * k, locks))
        _print(name, n, k, rows, [r for r in results if r["shape"] == name and r["rows"] == rows])
    return results


def _measure(name: str, rows: int, label: str, fn: Callable[[int], torch.Tensor], copies: int,
             ref: torch.Tensor | None, ref_scale: float, weight_bytes: int, locks: torch.Tensor) -> dict:
    row = {"shape": name, "rows": rows, "variant": label}
    try:
        if ref is not None:
            first = fn(0).float()
            err = (first - ref).abs().max().item() / ref_scale
            row["rel_err"] = err
            if err > MAX_REL_ERR:
                row["error"] = f"disagrees with w8a8_reference: rel err {err:.2e}"
                return row
        us = time_us(fn, copies)
        if ref is not None:  # still right after the timed calls: split-K counters back at zero
            again = (fn(0).float() - ref).abs().max().item() / ref_scale
            if again > MAX_REL_ERR or bool(locks.any()):
                row["error"] = f"wrong after timing (rel err {again:.2e}, counters {int(locks.count_nonzero())})"
                return row
    except Exception as e:  # a tile config the compiler rejects (registers, shared memory)
        row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
        return row
    row.update(us=us, tb_s=weight_bytes / us / 1e6)
    return row


def _print(name: str, n: int, k: int, rows: int, results: list[dict]) -> None:
    print(f"{name} N={n} K={k} rows={rows} (default int8 tiles {tuple(int8_gemv_config(n, k))})")
    timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
    grid_rows = [r for r in timed if r["variant"].startswith("grid")]
    shown = [r for r in timed if r not in grid_rows] + grid_rows[:5]
    for r in shown:
        err = f" rel err {r['rel_err']:.1e}" if "rel_err" in r else ""
        print(f"   {r['variant']:<40} {r['us']:9.1f} us  {r['tb_s']:5.2f} TB/s{err}", flush=True)
    for r in results:
        if "error" in r:
            print(f"   {r['variant']:<40} FAILED {r['error']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="run on the CPU interpreter at one tiny shape")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.smoke:
        device, dtype, shapes, rows_list, grid = "cpu", torch.float32, SMOKE_SHAPES, [1, 4, 16], False
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --smoke)")
        device, dtype, grid = "cuda", torch.bfloat16, os.environ.get("GRID") == "1"
        names = os.environ.get("SHAPES", ",".join(SHAPES)).split(",")
        shapes = {k: SHAPES[k] for k in names}
        rows_list = [int(r) for r in os.environ.get("ROWS", "1,4,16").split(",")]
    results = []
    for name, (n, k, has_bias) in shapes.items():
        results += bench_shape(name, n, k, has_bias, rows_list, grid, device, dtype)
    with open(os.path.join(OUT, "int8_gemv.json"), "w") as f:
        json.dump(results, f, indent=1)
    core_failed = [r for r in results if "error" in r and not r["variant"].startswith("grid")]
    if core_failed:  # a grid config the compiler rejects is expected; the default paths must all run
        raise SystemExit(f"{len(core_failed)} variant(s) failed their correctness check")


if __name__ == "__main__":
    main()
