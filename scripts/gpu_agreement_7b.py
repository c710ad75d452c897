"""Greedy-token agreement between flashvlm (Triton + CUDA graphs, bf16) and transformers on the
Qwen2-VL-7B config with the same random weights, over 16 prompts with one 448x448 image each, 64 tokens.

    PYTHONPATH=. python scripts/gpu_agreement_7b.py      # GPU only; writes $OUT/agreement_7b.json
    QUANTIZATION=fp8 KV_CACHE_DTYPE=fp8 PYTHONPATH=. python scripts/gpu_agreement_7b.py   # ours quantized

With QUANTIZATION (fp8, int8, int4) and/or KV_CACHE_DTYPE (fp8) flashvlm runs quantized against transformers in
bf16 on the same weights, so the teacher-forced agreement at decisive positions is the quantization's own cost
(bf16 flashvlm agrees with transformers there); the result file is then agreement_7b_<settings>.json.

transformers initialises the model (seeded), saves it as a normal checkpoint, and flashvlm loads that folder
through its real loader, so both run identical weights. Random weights give flat next-token distributions, so
bf16 rounding differences flip near-ties: the report gives the exact-sequence count, the token agreement up to
the first divergence, how far apart the two systems' first-step logits are, and the teacher-forced agreement
(our next token after each prefix of transformers' continuation), where one flip costs one position: over all
positions, and over the decisive ones, where transformers' top-two margin exceeds DECISIVE_GAP (4 bf16 ulps).
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
import time

import torch

from flashvlm import LLM, SamplingParams
from flashvlm.bench.baselines.transformers_baseline import TransformersBaseline
from flashvlm.bench.model_configs import write_benchmark_model
from flashvlm.bench.workloads import WorkloadSpec, generate_workload

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
NUM_PROMPTS, MAX_TOKENS = 16, 64
DECISIVE_GAP = 0.125


def teacher_forced_agreement(llm: LLM, requests: list, hf_tokens: list[list[int]],
                             hf_gaps: list[list[float]]) -> dict:
    """Our greedy next token after every prefix of transformers' own continuation (prompt + its first k tokens),
    against its token k. Free-running sequences part at the first near-tie and then compare different contexts;
    this compares every position in transformers' context, so one flip costs one position, not the rest.
    The forced prompts share their image and prefix, so the prefix cache makes each an extend of a few tokens."""
    prompts, targets, gaps, skipped = [], [], [], 0
    image_token = llm.engine.model.image_token_id
    for req, tokens, req_gaps in zip(requests, hf_tokens, hf_gaps):
        prompt = req.engine_prompt()
        ids = llm.engine.process_prompt(prompt).prompt_token_ids
        for k, token in enumerate(tokens):
            if image_token in tokens[:k]:  # a random model may emit the image placeholder: not a valid prompt
                skipped += len(tokens) - k
                break
            prompts.append({"prompt_token_ids": ids + tokens[:k], "images": prompt["images"]})
            targets.append(token)
            gaps.append(req_gaps[k])
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    agree = [o.token_ids[0] == t for o, t in zip(outs, targets)]
    # Positions where transformers' own top two logits are further apart than bf16 rounding can move them
    # (4 ulps at the logits' magnitude, 4-8 here): there a different token is a real disagreement, not a tie.
    decisive = [a for a, g in zip(agree, gaps) if g > DECISIVE_GAP]
    return {"teacher_forced_positions": len(agree), "teacher_forced_skipped": skipped,
            "teacher_forced_agreement": sum(agree) / len(agree),
            "decisive_gap": DECISIVE_GAP, "teacher_forced_decisive_positions": len(decisive),
            "teacher_forced_decisive_agreement": sum(decisive) / max(1, len(decisive)),
            "teacher_forced_top2_gaps_where_they_differ": sorted(g for a, g in zip(agree, gaps) if not a)}


def main() -> None:
    out_dir = os.environ.get("OUT") or tempfile.mkdtemp()
    smoke = os.environ.get("SMOKE") == "1"  # the same flow on a tiny model on the CPU, to check the script
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    if smoke:
        from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

        path = build_qwen2_vl(tempfile.mkdtemp(prefix="tiny-"), seed=3)
    else:
        path = write_benchmark_model("qwen2-vl-7b", tempfile.mkdtemp(prefix="q7b-weights-"))
    t0 = time.time()
    base = TransformersBaseline(str(path), dtype=dtype, device=device, load_format="dummy", seed=0)
    base.model.save_pretrained(path)
    print(f"random 7B initialised and saved in {time.time() - t0:.0f}s", flush=True)

    spec = WorkloadSpec(num_requests=NUM_PROMPTS, image_sizes=[(448, 448)], text_tokens=(16, 48),
                        output_tokens=MAX_TOKENS, seed=7)
    words = None if smoke else [f"w{i}" for i in range(1000, 9000)]
    requests = generate_workload(spec, PLACEHOLDER, vocab_words=words)
    hf_tokens, hf_first, hf_gaps = [], [], []
    for req in requests:
        inputs = base._batch_inputs([base._process(req)])
        with torch.inference_mode():
            res = base.model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                      do_sample=False, pad_token_id=base.pad_id, output_scores=True,
                                      return_dict_in_generate=True)
        n = inputs["input_ids"].shape[1]
        hf_tokens.append(res.sequences[0, n:].tolist())
        hf_first.append(res.scores[0][0].float().cpu())
        top2 = torch.stack([step[0].float().topk(2).values for step in res.scores])
        hf_gaps.append((top2[:, 0] - top2[:, 1]).tolist())
    del base
    gc.collect()
    if not smoke:
        torch.cuda.empty_cache()

    quant = {k: v for k, v in (("quantization", os.environ.get("QUANTIZATION")),
                               ("kv_cache_dtype", os.environ.get("KV_CACHE_DTYPE"))) if v}
    llm = LLM(str(path), dtype=dtype, device=device, max_num_seqs=16, gpu_memory_utilization=0.6,
              max_model_len=4096, **({"kv_cache_tokens": 16384} if smoke else {}), **quant)
    llm.engine.runner.record_logits = True
    outs = llm.generate([r.engine_prompt() for r in requests],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    ours = [o.token_ids for o in outs]
    ours_first = [llm.engine.runner.recorded_logits[o.request_id][0] for o in outs]

    llm.engine.runner.record_logits = False
    forced = teacher_forced_agreement(llm, requests, hf_tokens, hf_gaps)

    identical = sum(a == b for a, b in zip(ours, hf_tokens))
    positional = sum(x == y for a, b in zip(ours, hf_tokens) for x, y in zip(a, b)) / (NUM_PROMPTS * MAX_TOKENS)
    prefixes = []
    for a, b in zip(ours, hf_tokens):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefixes.append(k)
    # Tokens generated before the first divergence, over all tokens: after a flip the two continue from
    # different contexts, so later positions no longer compare like with like.
    before_divergence = sum(prefixes) / (NUM_PROMPTS * MAX_TOKENS)
    first_argmax_equal = sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(ours_first, hf_first))
    # transformers' scores hold -inf where min_new_tokens bans the stop tokens; compare the finite entries.
    finite = [torch.isfinite(a) & torch.isfinite(b) for a, b in zip(ours_first, hf_first)]
    max_diff = max((a - b)[m].abs().max().item() for a, b, m in zip(ours_first, hf_first, finite))
    scale = max(b[m].abs().max().item() for b, m in zip(hf_first, finite))
    # transformers' gap between its top two logits where the two first part: small gaps are bf16 near-ties.
    gaps_at_divergence = [g[k] for g, k in zip(hf_gaps, prefixes) if k < MAX_TOKENS]
    median_gap = sorted(x for g in hf_gaps for x in g)[NUM_PROMPTS * MAX_TOKENS // 2]
    result = {"flashvlm_settings": quant or "bf16", "prompts": NUM_PROMPTS, "max_tokens": MAX_TOKENS,
              "identical_sequences": identical,
              "positional_token_agreement": positional, "agreement_before_first_divergence": before_divergence,
              "first_divergence_positions": prefixes, "first_token_argmax_equal": first_argmax_equal,
              "first_step_logits_max_abs_diff": max_diff, "first_step_logits_max_abs": scale,
              "top2_gap_at_divergence": gaps_at_divergence, "median_top2_gap": median_gap, **forced}
    print(json.dumps(result, indent=1))
    suffix = "".join(f"_{k}-{v}" for k, v in quant.items())
    with open(os.path.join(out_dir, f"agreement_7b{suffix}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
