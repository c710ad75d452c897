"""Decode throughput at batch 32 with and without structured outputs, in one run (the issue's 10% budget).

The Qwen2-VL-7B config with random weights; 32 prompts of 64 tokens, each generating 256 tokens: once
unconstrained (ignore_eos), once each constrained by a regex, and once half and half. Prints output tokens per
second of each and the ratio to the unconstrained run (each run warmed once).

The benchmark model's tokenizer has one word `w<id>` per id, so the regex `(w7[0-9]*)+` allows the 11,111 words
whose id starts with 7 (7.3% of the vocabulary; a letters-only regex would allow none of its words). The tiny test
checkpoint has a real tokenizer and takes `[a-z]+`. Constrained rows set min_tokens to the length and keep EOS a
stop token (no ignore_eos), so the min_tokens ban keeps EOS out of their masks: with ignore_eos EOS is not banned,
the grammar (complete after any word) accepts it, and its end ends the request early.

    PYTHONPATH=. python scripts/gpu_structured_throughput.py                 # GPU
    PYTHONPATH=. python scripts/gpu_structured_throughput.py --tiny --batch 4 --max-tokens 32   # CPU smoke run
"""

from __future__ import annotations

import argparse
import tempfile
import time

from flashvlm import LLM, SamplingParams
from flashvlm.structured.params import StructuredOutputsParams


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> tuple[float, int]:
    llm.generate(prompts, params)  # warm-up: graphs, the grammar compile cache
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="the tiny test checkpoint on the CPU")
    args = ap.parse_args()
    if args.tiny:
        from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

        llm = LLM(str(build_qwen2_vl(tempfile.mkdtemp(), seed=1)), device="cpu", dtype="float32",
                  max_model_len=1024)
    else:
        from flashvlm.bench.model_configs import write_benchmark_model

        path = write_benchmark_model("qwen2-vl-7b", tempfile.mkdtemp(prefix="flashvlm-structured-"))
        llm = LLM(str(path), load_format="dummy", max_num_seqs=args.batch, max_model_len=1024)
    n, t = args.batch, args.max_tokens
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(n)]
    plain = SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True)
    regex = StructuredOutputsParams(regex="[a-z]+" if args.tiny else "(w7[0-9]*)+")
    constrained = SamplingParams(temperature=0.0, max_tokens=t, min_tokens=t, structured_outputs=regex)
    runs = {"unconstrained": [plain] * n, "all constrained": [constrained] * n,
            "half constrained": [constrained if i % 2 else plain for i in range(n)]}
    base = None
    for name, params in runs.items():
        elapsed, tokens = _run(llm, prompts, params)
        rate = tokens / elapsed
        base = base or rate
        short = "" if tokens == n * t else f"  (expected {n * t} tokens: some requests ended early)"
        print(f"{name:17s}: {tokens} tokens in {elapsed:.2f} s = {rate:.0f} tok/s "
              f"({rate / base:.1%} of unconstrained){short}")


if __name__ == "__main__":
    main()
