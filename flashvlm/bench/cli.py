"""`flashvlm bench latency | throughput | serve | sweep | compare`."""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flashvlm.bench.records import BenchRequest, ScenarioResult
from flashvlm.extras import require_extra

BENCHMARK_MODELS = ["fuyu-8b", "llava-1.5-7b", "llava-v1.6-mistral-7b", "qwen2-vl-7b", "qwen2.5-vl-7b", "qwen3-vl-8b"]
"""`--benchmark-model` choices, listed here so the parser imports no model code (model_configs.py writes them)."""

if TYPE_CHECKING:
    from flashvlm.bench.baselines.vllm_baseline import VLLMBaseline


def add_workload_args(p: argparse.ArgumentParser, with_seed: bool = True) -> None:
    g = p.add_argument_group("workload (seeded, deterministic)")
    g.add_argument("--num-requests", type=int, default=16, help="requests in the workload")
    g.add_argument("--image-size", default="448x448",
                   help="WxH, or a mix 'WxH:p,WxH:p' (e.g. 448x448:0.5,1344x1344:0.5); 'none' for text only")
    g.add_argument("--images-per-request", default="1", help="N or LO-HI")
    g.add_argument("--text-tokens", default="64", help="prompt text tokens: N or LO-HI")
    g.add_argument("--output-tokens", default="128", help="generated tokens (fixed length, eos ignored): N or LO-HI")
    g.add_argument("--repeated-image-ratio", type=float, default=0.0,
                   help="fraction of requests that reuse an earlier request's image (cache benchmarks)")
    g.add_argument("--long-context", action="store_true",
                   help="stress preset: 16K text tokens + one 1344x1344 image per request")
    g.add_argument("--dataset", default=None, help="JSONL of {prompt, images: [paths], max_tokens?} instead")
    g.add_argument("--video", default=None, metavar="FRAMESxWxH",
                   help="add one synthetic video of FRAMES frames of WxH to each request, e.g. 16x640x360 (Qwen-VL "
                        "models; offline scenarios and the transformers baseline only)")
    if with_seed:  # offline scenarios share the engine's --seed (weights, sampling and workload)
        g.add_argument("--seed", type=int, default=0, help="workload seed")


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("report")
    g.add_argument("--out", default=None, help="write results.json, report.md and plots/ here")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_model_args(p: argparse.ArgumentParser) -> None:
    from flashvlm.options import add_engine_args

    add_engine_args(p)
    g = p.add_argument_group("benchmark model and baseline")
    g.add_argument("--benchmark-model", default=None, choices=BENCHMARK_MODELS,
                   help="a real-size config with random weights (implies --load-format dummy)")
    g.add_argument("--baseline", default=None, choices=["transformers", "vllm"],
                   help="also run the workload through this system and report ratios (vllm: in a subprocess, "
                        "docs/bench.md)")
    g.add_argument("--baseline-python", default=None, metavar="PATH",
                   help="interpreter of the vllm baseline's subprocess, e.g. a venv that has vLLM "
                        "(default: the one running flashvlm%(default).0s)")
    g.add_argument("--baseline-vllm-kwargs", default=None, metavar="JSON",
                   help='extra or replaced vllm.LLM keywords of the vllm baseline, e.g. \'{"quantization": "fp8"}\'')
    g.add_argument("--baseline-batch-size", type=int, default=8, help="static batch size of the throughput baseline")
    g.add_argument("--warmup", type=int, default=1, help="warm-up requests (not measured)")
    g.add_argument("--peak-tflops", type=float, default=790.0, help="bf16 peak for the prefill floor (H200: ~790)")
    g.add_argument("--peak-bandwidth", type=float, default=4.2, help="TB/s for the decode floor (H200: ~4.2)")


def build_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="reproducible benchmarks with per-stage latency attribution",
                           description="Benchmarks: latency (one request at a time), throughput (all at once), "
                                       "serve (load against an OpenAI-compatible endpoint), sweep (several engine "
                                       "configs), compare (two results.json files).")
    scen = bench.add_subparsers(dest="scenario", metavar="SCENARIO", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter
    for name, help_text in (("latency", "single stream (MLPerf SingleStream): TTFT, TPOT, E2E percentiles"),
                            ("throughput", "offline (MLPerf Offline): all requests at once; tokens/s, peak memory"),
                            ("multiturn", "single stream, each request followed by a follow-up turn on the same "
                                          "images: TTFT of first and follow-up turns (prefix caching)")):
        p = scen.add_parser(name, help=help_text, description=help_text, formatter_class=fmt)
        add_model_args(p)
        add_workload_args(p, with_seed=False)
        add_output_args(p)
    p = scen.add_parser("serve", help="load generator against an OpenAI-compatible endpoint", formatter_class=fmt,
                        description="Streams requests to any OpenAI-compatible server and measures TTFT, TPOT, ITL "
                                    "and E2E on the client side, with the same definitions as `vllm bench serve`.")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model", default="default", help="the model name the server expects")
    p.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson arrivals; gamma shape otherwise")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--tier", default=None,
                   help="SLA tier sent as the x-sla-tier header: one name, or a seeded mix such as "
                        "'gold:0.2,bronze:0.8' (the report then adds one row per tier)")
    add_workload_args(p)
    add_output_args(p)
    p = scen.add_parser("sweep", help="one workload over several engine configurations, ranked",
                        formatter_class=fmt,
                        description="Runs the workload once per engine configuration and ranks them; the first "
                                    "configuration is the baseline row of the ratio table.")
    p.add_argument("--configs", required=True,
                   help='JSON list (or a file holding one) of {"name": ..., <engine option>: value, ...} '
                        '(option names as LLM keywords, docs/engine.md)')
    p.add_argument("--sweep-scenario", default="throughput", choices=["latency", "throughput", "multiturn"])
    add_model_args(p)
    add_workload_args(p, with_seed=False)
    add_output_args(p)
    p = scen.add_parser("compare", help="ratio table of two results.json files; exit 1 on a regression",
                        formatter_class=fmt)
    p.add_argument("a", help="the reference results.json")
    p.add_argument("b", help="the new results.json")
    p.add_argument("--threshold", type=float, default=0.1, help="relative change that counts as a regression")


# ---- workload ----------------------------------------------------------------------------------
def _workload(args: argparse.Namespace, placeholder: str,
              video_placeholder: str | None = None) -> tuple[list[BenchRequest], dict[str, Any]]:
    requests, workload = _image_workload(args, placeholder)
    if getattr(args, "video", None):
        from flashvlm.bench.video_workload import add_videos

        requests = add_videos(requests, args.video, video_placeholder, args.seed)
        workload = {**workload, "video": args.video}
    return requests, workload


def _image_workload(args: argparse.Namespace, placeholder: str) -> tuple[list[BenchRequest], dict[str, Any]]:
    from flashvlm.bench import workloads as wl

    if args.dataset:
        reqs = wl.load_jsonl(args.dataset, placeholder=placeholder or None)
        return reqs, {"dataset": str(args.dataset), "num_requests": len(reqs)}
    if args.long_context:
        spec = wl.long_context_stress(num_requests=args.num_requests, seed=args.seed)
    else:
        size = None if args.image_size.lower() == "none" else args.image_size
        spec = wl.WorkloadSpec.from_cli(num_requests=args.num_requests, image_size=size,
                                        images_per_request=args.images_per_request, text_tokens=args.text_tokens,
                                        output_tokens=args.output_tokens,
                                        repeated_image_ratio=args.repeated_image_ratio, seed=args.seed)
    return wl.generate_workload(spec, placeholder), spec.to_dict()


def _model_path(args: argparse.Namespace) -> str:
    if args.benchmark_model:
        from flashvlm.bench.model_configs import write_benchmark_model

        args.load_format = "dummy"
        return str(write_benchmark_model(args.benchmark_model, tempfile.mkdtemp(prefix="flashvlm-bench-")))
    from flashvlm.models.default import resolve_model

    return resolve_model(args.model)


def _progress(args: argparse.Namespace, total: int, desc: str):
    if args.no_progress:
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)
    return bar, bar.update


def _finish(result: ScenarioResult, args: argparse.Namespace, floors=None,
            requests: list[BenchRequest] | None = None) -> ScenarioResult:
    from flashvlm.bench.metrics import parse_goodput, percentiles, summarize

    summary = summarize(result, parse_goodput(args.goodput) if args.goodput else None)
    ttft = {r.request_id: r.ttft * 1e3 for r in result.records if r.success and r.ttft is not None}
    if result.scenario == "multiturn":
        for turn in ("turn1", "turn2"):
            summary[f"{turn}_ttft_ms"] = percentiles(v for k, v in ttft.items() if k.endswith("/" + turn))
    elif requests and any(r.image_keys for r in requests):
        # TTFT split by whether a request's images all appeared earlier in the workload (cache benchmarks).
        seen: set[str] = set()
        first, repeat = [], []
        for req in requests:
            if req.request_id in ttft and req.image_keys:
                (repeat if all(k in seen for k in req.image_keys) else first).append(ttft[req.request_id])
            seen.update(req.image_keys)
        if repeat:
            summary["ttft_first_image_ms"] = percentiles(first)
            summary["ttft_repeated_image_ms"] = percentiles(repeat)
    decode_steps = [s.host_s * 1e3 for s in result.steps if s.num_prefill_tokens == 0]
    if decode_steps:  # host (CPU) time per pure-decode step: what CUDA graphs and fewer syncs cut
        from flashvlm.bench.metrics import percentiles

        summary["decode_step_host_ms"] = percentiles(decode_steps)
    if floors is not None:
        summary["floors"] = floors.achieved(summary)
    return result


def _model_cost(llm):
    from flashvlm.bench.floors import model_cost

    return model_cost(llm.engine.model, kv_element_size=llm.engine.runner.kv_dtype.itemsize)


def _floors(llm, requests: list[BenchRequest], args: argparse.Namespace, result: ScenarioResult):
    """Throughput runs: the floor of the whole run, from the requests as `result` processed them; latency
    scenarios: per-request floors of the workload's mean request."""
    from flashvlm.bench.floors import run_floor, run_work, workload_floors

    if result.scenario == "throughput":
        return run_floor(_model_cost(llm), run_work(result.records, requests),
                         llm.engine.config.scheduler.max_num_seqs, bandwidth=args.peak_bandwidth * 1e12,
                         peak_flops=args.peak_tflops * 1e12)
    n = max(len(requests), 1)
    processed = [llm.engine.process_prompt(r.engine_prompt()) for r in requests[: min(n, 8)]]
    prompt = sum(len(p.prompt_token_ids) for p in processed) / len(processed)
    family = llm.engine.checkpoint.family
    patches = sum(family.vision_patches(it) for p in processed for it in p.mm_items) / len(processed)
    output = sum(r.max_tokens for r in requests) / n
    return workload_floors(_model_cost(llm), prompt, output, patches,
                           bandwidth=args.peak_bandwidth * 1e12, peak_flops=args.peak_tflops * 1e12)


def _free_device_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:  # pragma: no cover
        pass


def _run_offline(args: argparse.Namespace, scenario: str, configs: list[dict[str, Any]]) -> list[ScenarioResult]:
    from flashvlm.bench.scenarios import SCENARIOS, warm_up
    from flashvlm.llm import LLM
    from flashvlm.options import engine_config_from_args

    if getattr(args, "video", None) and (scenario == "multiturn" or getattr(args, "baseline", None) == "vllm"):
        raise ValueError("--video runs the latency and throughput scenarios, with or without the transformers "
                         "baseline (the multiturn scenario and the vllm baseline send no videos)")
    path = _model_path(args)
    vllm_base = _vllm_baseline(args, path) if getattr(args, "baseline", None) == "vllm" else None
    runs: list[ScenarioResult] = []
    requests: list[BenchRequest] = []
    workload: dict[str, Any] = {}
    floors = None
    for cfg in configs:
        cfg = dict(cfg)
        label = cfg.pop("name", "flashvlm")
        llm = LLM.from_config(engine_config_from_args(args, model=path, **cfg))
        if not requests:
            family = llm.engine.checkpoint.family
            requests, workload = _workload(args, family.image_placeholder, family.video_placeholder)
        warm_up(llm, requests, args.warmup)
        bar, update = _progress(args, len(requests), f"{scenario} [{label}]")
        result = SCENARIOS[scenario](llm, requests, workload, label=label, progress=update)
        if bar is not None:
            bar.close()
        # Each configuration's own floor (quantized weights or an FP8 KV cache read fewer bytes); the baselines
        # take the first configuration's.
        own_floors = _floors(llm, requests, args, result)
        floors = floors or own_floors
        runs.append(_finish(result, args, own_floors, requests))
        del llm  # each configuration gets the whole device
        _free_device_memory()
    if getattr(args, "baseline", None) == "transformers":
        runs.insert(0, _run_transformers(args, path, scenario, requests, workload, floors))
    elif vllm_base is not None:
        result = vllm_base.run(scenario, requests, workload, warmup=args.warmup, reference=runs[0])
        runs.insert(0, _finish(result, args, floors, requests))  # the baseline row of ratio tables
    return runs


def _vllm_baseline(args: argparse.Namespace, path: str) -> VLLMBaseline:
    """The vLLM baseline, checked (model family, vLLM importing in --baseline-python) before any engine starts."""
    from flashvlm.bench.baselines.vllm_baseline import VLLMBaseline, vllm_llm_kwargs

    base = VLLMBaseline(path, vllm_llm_kwargs(args, path), python=args.baseline_python, device=args.device)
    version = base.check()
    print(f"vllm baseline: vLLM {version} imports in {base.python}", file=sys.stderr)
    return base


def _run_transformers(args: argparse.Namespace, path: str, scenario: str, requests: list[BenchRequest],
                      workload: dict[str, Any], floors) -> ScenarioResult:
    from flashvlm.bench.baselines.transformers_baseline import TransformersBaseline

    dtype = args.dtype if args.dtype != "auto" else ("float32" if args.device == "cpu" else "bfloat16")
    device = args.device if args.device != "auto" else _default_device()
    base = TransformersBaseline(path, dtype=dtype, device=device, load_format=args.load_format, seed=args.seed)
    base.warm_up(requests, args.warmup)
    bar, update = _progress(args, len(requests), f"{scenario} [transformers]")
    if scenario == "latency":
        result = base.run_latency(requests, workload, progress=update)
    else:
        result = base.run_throughput(requests, workload, batch_size=args.baseline_batch_size, progress=update)
    if bar is not None:
        bar.close()
    del base
    _free_device_memory()
    return _finish(result, args, floors)  # the caller puts it first: the baseline row of ratio tables


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _run_serve(args: argparse.Namespace) -> list[ScenarioResult]:
    from flashvlm.bench.loadgen import run_load_sync
    from flashvlm.bench.workloads import arrival_times, assign_tiers, parse_tier_mix

    if getattr(args, "video", None):
        raise ValueError("--video: the serve scenario sends no videos yet; use an offline scenario")
    requests, workload = _workload(args, "")
    offsets = None
    if args.request_rate != float("inf"):
        offsets = arrival_times(len(requests), args.request_rate, args.burstiness, seed=args.seed)
    mix = parse_tier_mix(args.tier) if args.tier else []
    tiers = assign_tiers(len(requests), mix, args.seed) if mix else [None] * len(requests)
    records, duration = run_load_sync(args.base_url, args.served_model, requests, arrival_offsets=offsets,
                                      max_concurrency=args.max_concurrency, endpoint=args.endpoint,
                                      progress=not args.no_progress, extra_body={"ignore_eos": True},
                                      request_headers=[{"x-sla-tier": t} if t else None for t in tiers])
    for rec, tier in zip(records, tiers):
        rec.tier = tier
    workload = {**workload, "request_rate": args.request_rate, "burstiness": args.burstiness,
                "max_concurrency": args.max_concurrency, "endpoint": args.endpoint, "tiers": args.tier}
    config = {"base_url": args.base_url, "model": args.served_model}
    results = [ScenarioResult(scenario="serve", label=args.served_model, config=config, workload=workload,
                              records=records, duration_s=duration)]
    if len(mix) > 1:  # one more row per tier: each tier's percentiles against its own targets
        for name, _ in mix:
            subset = [r for r in records if r.tier == name]
            results.append(ScenarioResult(scenario="serve", label=f"{args.served_model}[{name}]", config=config,
                                          workload={**workload, "tier": name}, records=subset, duration_s=duration))
    return [_finish(r, args) for r in results]


def _configs_text(spec: str) -> str:
    """--configs is either the JSON list itself or the path of a file holding it."""
    if spec.lstrip().startswith("["):
        return spec
    try:
        return Path(spec).read_text()
    except OSError as e:
        raise ValueError(f"--configs: cannot read {spec!r}: {e}") from None


def _load_configs(spec: str) -> list[dict[str, Any]]:
    text = _configs_text(spec)
    try:
        configs = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--configs is neither a JSON list nor a file holding one: {e}") from None
    if not isinstance(configs, list) or not configs or not all(isinstance(c, dict) for c in configs):
        raise ValueError("--configs must be a non-empty JSON list of objects")
    for i, c in enumerate(configs):
        c.setdefault("name", f"config{i}")
    return configs


def run(args: argparse.Namespace) -> int:
    from flashvlm.bench.metrics import ratio_table
    from flashvlm.bench.report import environment_fingerprint, format_table, write_results

    if args.scenario == "compare":
        from flashvlm.bench.compare import main_compare

        return main_compare(args.a, args.b, args.threshold)
    require_extra("bench", "flashvlm bench", (["httpx"] if args.scenario == "serve" else []) +
                  (["matplotlib"] if args.out else []))
    if args.scenario == "serve":
        runs = _run_serve(args)
    elif args.scenario == "sweep":
        runs = _run_offline(args, args.sweep_scenario, _load_configs(args.configs))
    else:
        runs = _run_offline(args, args.scenario, [{"name": "flashvlm"}])
    if len(runs) > 1 and args.scenario != "serve":  # serve's extra rows are tiers of one run, not systems
        for row, run_ in zip(ratio_table([{"label": r.label, **r.summary} for r in runs]), runs):
            run_.summary["ratios"] = row["ratios"]
    print(format_table(runs))
    if args.out:
        env = environment_fingerprint(runs[-1].config)
        path = write_results(args.out, runs, sys.argv, env)
        print(f"wrote {path} and {Path(path).parent / 'report.md'}", file=sys.stderr)
    return 0
