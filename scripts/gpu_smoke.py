"""GPU smoke run for the engine core (issue 2): Qwen2-VL-7B config, random weights, bf16, reference
attention backend. Prints a table and writes JSON under $OUT.

    PYTHONPATH=. python scripts/gpu_smoke.py

1. Tiny Qwen2-VL on the GPU, float32: greedy tokens equal transformers' generate.
2. 7B config, one request at a time (1008x756 image + 64 text tokens -> 128 tokens): TTFT, TPOT.
3. 7B config, 16 concurrent requests with images: TTFT percentiles, output tok/s.
4. transformers generate on the same config and input, same process, as the baseline.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.bench.model_configs import QWEN_SPECIAL_IDS, write_benchmark_model

OUT = os.environ.get("OUT") or tempfile.mkdtemp()
RESULTS: dict = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                 "gpu": torch.cuda.get_device_name(0)}


def log(*a) -> None:
    print(*a, flush=True)


def image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def prompt_ids(n_text: int, seed: int) -> list[int]:
    g = np.random.default_rng(seed)
    text = g.integers(1000, 100000, n_text).tolist()
    vs, ve, pad = (QWEN_SPECIAL_IDS[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    return text[:8] + [vs, pad, ve] + text[8:]


def tiny_parity() -> None:
    from transformers import Qwen2VLForConditionalGeneration

    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

    path = build_qwen2_vl(tempfile.mkdtemp(), seed=7)
    llm = LLM(str(path), device="cuda", dtype="float32", kv_cache_tokens=8192)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).cuda().eval()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt": "<|vision_start|><|image_pad|><|vision_end|>" + t, "images": [image(56 * k, 84, k)]}
               for k, t in enumerate(["Describe.", "What colour?", "How many shapes are there?"], 1)]
    outs = llm.generate(prompts, params)
    agree = 0
    for p, o in zip(prompts, outs):
        pp = llm.engine.process_prompt(p)
        ids = torch.tensor([pp.prompt_token_ids], device="cuda")
        it = pp.mm_items[0]
        with torch.inference_mode():
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=it.model_pixels().cuda(),
                              image_grid_thw=torch.tensor([it.layout], device="cuda"), max_new_tokens=32,
                              mm_token_type_ids=(ids == llm.engine.model.image_token_id).long(),
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        agree += int(ref[0, ids.shape[1]:].tolist() == o.token_ids)
    RESULTS["tiny_gpu_fp32_parity"] = f"{agree}/{len(prompts)}"
    log("tiny fp32 parity on GPU:", RESULTS["tiny_gpu_fp32_parity"])
    del llm, hf
    torch.cuda.empty_cache()


def run_ours(path: str) -> None:
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=16,
              max_num_batched_tokens=4096, gpu_memory_utilization=0.6)
    RESULTS["ours_load_s"] = time.perf_counter() - t0
    RESULTS["kv_cache_blocks"] = llm.engine.config.cache.num_blocks
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    rows = []
    for h, w in [(448, 448), (1008, 756), (1344, 1344)]:
        p = {"prompt_token_ids": prompt_ids(64, 0), "images": [image(h, w, 0)]}
        llm.generate(p, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        ttfts, e2es, tpots = [], [], []
        for rep in range(3):
            p = {"prompt_token_ids": prompt_ids(64, rep + 1), "images": [image(h, w, rep + 1)]}
            torch.cuda.synchronize()
            t = time.perf_counter()
            wall0 = time.time()
            out = llm.generate(p, params)[0]
            e2e = time.perf_counter() - t
            ttft = out.first_token_time - wall0
            ttfts.append(ttft)
            e2es.append(e2e)
            tpots.append((e2e - ttft) / (len(out.token_ids) - 1))
        row = dict(image=f"{h}x{w}", prompt_tokens=len(out.prompt_token_ids), ttft_ms=1e3 * statistics.median(ttfts),
                   tpot_ms=1e3 * statistics.median(tpots), e2e128_ms=1e3 * statistics.median(e2es),
                   decode_tok_s=1 / statistics.median(tpots))
        rows.append(row)
        log("ours single", row)
    RESULTS["ours_single"] = rows
    # 16 concurrent requests with images
    prompts = [{"prompt_token_ids": prompt_ids(64, 100 + i), "images": [image(1008, 756, 100 + i)]} for i in range(16)]
    torch.cuda.synchronize()
    wall0 = time.time()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    ttfts = sorted(o.first_token_time - wall0 for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    RESULTS["ours_batch16"] = dict(image="1008x756", requests=16, output_tokens=n_out, elapsed_s=elapsed,
                                   output_tok_s=n_out / elapsed, ttft_p50_ms=1e3 * ttfts[7],
                                   ttft_max_ms=1e3 * ttfts[-1], peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9)
    log("ours batch16", RESULTS["ours_batch16"])
    del llm
    torch.cuda.empty_cache()


def run_transformers(path: str) -> None:
    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    cfg = AutoConfig.from_pretrained(path)
    with torch.device("cuda"):
        model = Qwen2VLForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval()
    from PIL import Image

    from flashvlm.processing.preprocess import get_image_processor

    with open(os.path.join(path, "preprocessor_config.json")) as f:
        proc = get_image_processor(json.load(f), "qwen2_vl")

    pv, grid = proc.preprocess(Image.fromarray(image(1008, 756, 1)))
    n_img = proc.num_image_tokens(grid)
    ids = prompt_ids(64, 1)
    k = ids.index(QWEN_SPECIAL_IDS["<|image_pad|>"])
    ids = torch.tensor([ids[:k] + ids[k:k + 1] * n_img + ids[k + 1:]], device="cuda")
    inp = dict(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pv.cuda().bfloat16(),
               image_grid_thw=torch.tensor([grid], device="cuda"),
               mm_token_type_ids=(ids == QWEN_SPECIAL_IDS["<|image_pad|>"]).long())

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(**inp, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    timed(2)
    ttft = min(timed(1) for _ in range(2))
    e2e = timed(128)
    RESULTS["transformers_single"] = dict(image="1008x756", ttft_ms=1e3 * ttft, e2e128_ms=1e3 * e2e,
                                          tpot_ms=1e3 * (e2e - ttft) / 127, decode_tok_s=127 / (e2e - ttft))
    log("transformers single", RESULTS["transformers_single"])


def main() -> None:
    import traceback

    path = str(write_benchmark_model("qwen2-vl-7b", tempfile.mkdtemp()))
    stages = [tiny_parity, lambda: run_ours(path)]
    if "--no-baseline" not in sys.argv:
        stages.append(lambda: run_transformers(path))
    for stage in stages:  # one failing stage must not hide the others' numbers
        try:
            stage()
        except Exception:
            RESULTS.setdefault("errors", []).append(traceback.format_exc()[-2000:])
            traceback.print_exc()
    with open(os.path.join(OUT, "gpu_smoke.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    log(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
