"""Where a batch-1 request's time goes on the GPU: decode graph replay vs the measured TPOT (the rest is
host work per step), the kernels of one decode step, the kernels of the ViT + prefill for one 1008x756 image, where
the GPU idles inside that request's time to first token, and the host functions that take the time.

    PYTHONPATH=. python scripts/gpu_profile.py        # GPU only; tables on stdout, JSON in $OUT/profile.json
    STAGES=offline PYTHONPATH=. python scripts/gpu_profile.py   # only the kernels of one 512-request-run step
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import tempfile
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from flashvlm import LLM, SamplingParams
from flashvlm.bench.model_configs import write_benchmark_model

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def top_kernels(prof, n: int = 18) -> list[dict]:
    rows = []
    for evt in prof.key_averages():
        t = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if t > 0 and evt.device_type == torch.autograd.DeviceType.CUDA:
            rows.append({"kernel": evt.key[:90], "calls": evt.count, "total_us": t})
    rows.sort(key=lambda r: -r["total_us"])
    total = sum(r["total_us"] for r in rows)
    calls = sum(r["calls"] for r in rows)
    for r in rows[:n]:
        print(f"  {r['total_us']:9.0f} us {r['calls']:6d}x  {r['kernel']}")
    print(f"  {total:9.0f} us {calls:6d}x  (all kernels)")
    return [{"total_us": total, "calls": calls}] + rows[:n]


def ttft_idle(llm: LLM, rng: np.random.Generator, words: str) -> dict:
    """Where the GPU waits for the host inside one request's time to its first token: the time from the request's
    start to its first kernel, the idle gaps between kernels (over 5 us) until the last one, and after it."""
    img = rng.integers(0, 256, (756, 1008, 3), dtype=np.uint8)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("request"):
            llm.generate({"prompt": PLACEHOLDER + words, "images": [img]},
                         SamplingParams(temperature=0.0, max_tokens=1))
        torch.cuda.synchronize()
    events = prof.events()
    req = next(e for e in events if e.name == "request")
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.start >= req.time_range.start)
    gaps, busy_end = [], kernels[0][0]
    for start, end in kernels:
        if start - busy_end > 5:
            gaps.append((busy_end - req.time_range.start, start - busy_end))
        busy_end = max(busy_end, end)
    res = {"request_ms": (req.time_range.end - req.time_range.start) / 1e3,
           "before_first_kernel_ms": (kernels[0][0] - req.time_range.start) / 1e3,
           "gaps_ms": sum(g for _, g in gaps) / 1e3, "after_last_kernel_ms": (req.time_range.end - busy_end) / 1e3,
           "largest_gaps": [{"at_ms": round(a / 1e3, 3), "ms": round(g / 1e3, 3)}
                            for a, g in sorted(gaps, key=lambda x: -x[1])[:8]]}
    print("GPU idle inside one request (1 output token):", json.dumps(res))
    return res


def host_functions(llm: LLM, rng: np.random.Generator, words: str, n: int = 10) -> list[str]:
    """Host functions by own time over n fresh requests of 1 output token (waits for the GPU show as syncs)."""
    imgs = [rng.integers(0, 256, (756, 1008, 3), dtype=np.uint8) for _ in range(n)]
    prof = cProfile.Profile()
    prof.enable()
    for img in imgs:
        llm.generate({"prompt": PLACEHOLDER + words, "images": [img]}, SamplingParams(temperature=0.0, max_tokens=1))
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    lines = [line for line in text.getvalue().splitlines() if line.strip()][-26:]
    print(f"host functions by own time over {n} requests:")
    print("\n".join(lines))
    return lines


def offline_step(path: str) -> dict:
    """Kernels of one steady-state step of the 512-request offline run's shape: 8192-token budget, fresh 1008x756
    images, decode rows riding along with prefill chunks and the step's images encoded together."""
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_num_seqs=256, gpu_memory_utilization=0.9,
              max_model_len=4096, max_num_batched_tokens=8192)
    engine, rng = llm.engine, np.random.default_rng(1)
    words = " ".join(f"w{i}" for i in rng.integers(1000, 9000, 64))
    for _ in range(96):
        img = rng.integers(0, 256, (756, 1008, 3), dtype=np.uint8)
        engine.add_request({"prompt": PLACEHOLDER + words, "images": [img]},
                           SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True))
    for _ in range(4):  # warm-up: compiles, and decode rows join the prefill chunks
        engine.step()
    torch.cuda.synchronize()
    engine.step_log = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
    rec = engine.step_log[-1] if engine.step_log else None
    print(f"one offline step: {wall_ms:.1f} ms wall"
          + (f", {rec.num_prefill_tokens} prefill + {rec.num_decode_tokens} decode tokens, {rec.num_images} images"
             if rec else ""))
    return {"wall_ms": wall_ms, "kernels": top_kernels(prof, 30)}


def main() -> None:
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp()
    res: dict = {}
    path = write_benchmark_model("qwen2-vl-7b", tempfile.mkdtemp())
    if os.environ.get("STAGES") == "offline":
        res["offline_step"] = offline_step(str(path))
        with open(os.path.join(out_dir, "profile_offline.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    llm = LLM(str(path), load_format="dummy", dtype="bfloat16", max_num_seqs=8, gpu_memory_utilization=0.5,
              max_model_len=4096, max_num_batched_tokens=4096)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (756, 1008, 3), dtype=np.uint8)
    words = " ".join(f"w{i}" for i in rng.integers(1000, 9000, 64))
    prompt = {"prompt": PLACEHOLDER + words, "images": [image]}
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    tpots = []
    for k in range(3):
        img = rng.integers(0, 256, (756, 1008, 3), dtype=np.uint8)  # a fresh picture: no cache hits
        out = llm.generate({"prompt": PLACEHOLDER + words + f" w{k}", "images": [img]}, params)[0]
        st = out.stages
        tpots.append((st["decode"] + st["detokenize"]) / (len(out.token_ids) - 1) * 1e3)  # vLLM's TPOT
        res.setdefault("stages_ms", []).append({k: round(v * 1e3, 2) for k, v in st.items()})
    res["tpot_ms"] = float(np.median(tpots))

    graphs = llm.engine.runner.graphs
    graphs.seq_lens[:1].fill_(1100)  # a decode at about this request's length
    graph = graphs.graphs[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        graph.replay()
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    res["graph_replay_ms"] = start.elapsed_time(end) / 200
    res["host_ms_per_step"] = res["tpot_ms"] - res["graph_replay_ms"]
    print(f"TPOT {res['tpot_ms']:.3f} ms = decode graph replay {res['graph_replay_ms']:.3f} ms "
          f"+ {res['host_ms_per_step']:.3f} ms not overlapped (host work per step)", flush=True)

    print("kernels of one decode step (the graph's body run eagerly, batch 1):")
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphs._forward(1)
        torch.cuda.synchronize()
    res["decode_kernels"] = top_kernels(prof)

    print("kernels of vision + prefill (one fresh 1008x756 image + 64 words, 1 output token):")
    img = rng.integers(0, 256, (756, 1008, 3), dtype=np.uint8)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate({"prompt": PLACEHOLDER + words, "images": [img]},
                     SamplingParams(temperature=0.0, max_tokens=1))
        torch.cuda.synchronize()
    res["prefill_kernels"] = top_kernels(prof, 25)
    res["ttft_gpu_idle"] = ttft_idle(llm, rng, words)
    res["ttft_host_functions"] = host_functions(llm, rng, words)
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
