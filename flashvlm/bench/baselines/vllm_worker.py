"""The child side of the vLLM baseline: one benchmark scenario through vLLM's offline API, in its own process.

`vllm_baseline.py` starts it as a script (`python vllm_worker.py WORKDIR [--probe]`, with the interpreter of
`--baseline-python`) so that vLLM may live in another environment: it imports nothing of flashvlm, only the
standard library, numpy, PIL and vllm (torch through vllm). WORKDIR holds `job.json` (the engine keywords, the
scenario, the requests as prompt token ids before image expansion) and the requests' images as `.npy` files;
the worker writes `result.json` (request records in the shape of flashvlm's RequestRecord) or, when vLLM does not
import or the run fails, `error.json` naming the problem, and exits nonzero.

Timing follows flashvlm's own scenarios: host wall-clock stamps (time.time()) when the engine hands back tokens.
latency and multiturn step `llm.llm_engine` one request at a time, so every token gets a host stamp;
throughput is one `LLM.generate` call over all requests (vLLM's offline path), where per-token stamps do not
exist: TTFT and E2E then come from vLLM's per-request stats (RequestOutput.metrics, kept because
disable_log_stats=False): first token = arrival_time + first_token_latency (wall clock), last token = that plus
last_token_ts - first_token_ts (the engine core's monotonic stamps).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

EXIT_IMPORT = 3
EXIT_RUN = 4


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _load_image(spec: str, workdir: Path, mirrored: bool = False) -> Any:
    """A request image as a PIL RGB image: a `.npy` array the parent saved, or an image file of a dataset."""
    import numpy as np
    from PIL import Image

    path = Path(spec) if Path(spec).is_absolute() else workdir / spec
    if path.suffix == ".npy":
        array = np.load(path)
        if mirrored:  # warm-up copies: same size, other content, so no cache is seeded with a measured image
            array = np.ascontiguousarray(array[:, ::-1])
        image = Image.fromarray(array)
        return image if image.mode == "RGB" else image.convert("RGB")
    image = Image.open(path).convert("RGB")
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if mirrored else image


def _load_all(requests: list[dict[str, Any]], workdir: Path) -> list[list[Any]]:
    """Every request's images, each file loaded once (a repeated image is one file)."""
    loaded: dict[str, Any] = {}
    for req in requests:
        for spec in req["images"]:
            if spec not in loaded:
                loaded[spec] = _load_image(spec, workdir)
    return [[loaded[spec] for spec in req["images"]] for req in requests]


def _prompt(token_ids: list[int], images: list[Any]) -> dict[str, Any]:
    prompt: dict[str, Any] = {"prompt_token_ids": list(token_ids)}
    if images:
        prompt["multi_modal_data"] = {"image": images[0] if len(images) == 1 else images}
    return prompt


def _stats(output: Any) -> Any:
    """vLLM's per-request stats (RequestStateStats), or None when the engine keeps none."""
    metrics = getattr(output, "metrics", None)
    return metrics if metrics is not None and getattr(metrics, "arrival_time", 0.0) else None


def _engine_stages(stats: Any) -> dict[str, float]:
    """queue / prefill / decode from the engine core's monotonic stamps (prefill includes vision encoding)."""
    if stats is None:
        return {}
    queued, scheduled = getattr(stats, "queued_ts", 0.0), getattr(stats, "scheduled_ts", 0.0)
    first, last = getattr(stats, "first_token_ts", 0.0), getattr(stats, "last_token_ts", 0.0)
    stages = {}
    if queued and scheduled:
        stages["queue"] = max(0.0, scheduled - queued)
    if scheduled and first:
        stages["prefill"] = max(0.0, first - scheduled)
    if first and last:
        stages["decode"] = max(0.0, last - first)
    return stages


def _record(request_id: str, num_images: int, start: float) -> dict[str, Any]:
    return {"request_id": request_id, "success": True, "error": None, "prompt_tokens": 0, "output_tokens": 0,
            "num_images": num_images, "start_time": start, "ttft": None, "e2e": None, "itl": [], "stages": {}}


def _finish_record(rec: dict[str, Any], output: Any) -> None:
    completion = output.outputs[0]
    rec["prompt_tokens"] = len(output.prompt_token_ids or [])
    rec["output_tokens"] = len(completion.token_ids)
    rec["stages"] = _engine_stages(_stats(output))
    reason = getattr(completion, "finish_reason", "length")
    if reason not in ("stop", "length", None):
        rec["success"], rec["error"] = False, f"finished with {reason}"


class _Stepper:
    """One request at a time through `llm.llm_engine`, stamping each step's new tokens with the host clock."""

    def __init__(self, llm: Any) -> None:
        self.engine = llm.llm_engine

    def run(self, request_id: str, prompt: dict[str, Any], params: Any, num_images: int) -> tuple[dict, Any]:
        start = time.time()
        rec = _record(request_id, num_images, start)
        try:
            returned = self.engine.add_request(request_id, prompt, params, arrival_time=start)
        except ValueError as e:  # a request vLLM refuses is recorded; the run goes on
            rec["success"], rec["error"] = False, f"{type(e).__name__}: {e}"
            return rec, None
        ids = {request_id, returned} if isinstance(returned, str) else {request_id}
        seen, last, final = 0, start, None
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            now = time.time()
            for out in outputs:
                if out.request_id not in ids:
                    continue
                n = len(out.outputs[0].token_ids)
                if n > seen:
                    if rec["ttft"] is None:
                        rec["ttft"] = now - start
                    else:
                        rec["itl"].append(now - last)
                    seen, last = n, now
                if out.finished:
                    rec["e2e"] = now - start
                    _finish_record(rec, out)
                    final = out
        return rec, final


def _generate_all(llm: Any, prompts: list[dict], params: list[Any], ids: list[str],
                  num_images: list[int]) -> tuple[list[dict], float]:
    """All requests in one LLM.generate call; every request's clock starts when the call does."""
    start = time.time()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - t0
    records = []
    for request_id, images, out in zip(ids, num_images, outputs):  # LLM.generate keeps the input order
        rec = _record(request_id, images, start)
        _finish_record(rec, out)
        stats = _stats(out)
        if stats is not None and getattr(stats, "first_token_latency", 0.0):
            first = stats.arrival_time + stats.first_token_latency
            rec["ttft"] = first - start
            decode = rec["stages"].get("decode")
            rec["e2e"] = rec["ttft"] + decode if decode is not None else None
        records.append(rec)
    return records, duration


def _peak_memory_rpc(worker: Any = None) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None


def _reset_peak_rpc(worker: Any = None) -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _on_workers(llm: Any, fn: Any) -> list[Any]:
    """fn run where the model runs (vLLM's engine core is usually another process); [] when not possible."""
    try:
        return list(llm.collective_rpc(fn))
    except Exception:  # noqa: BLE001 - peak memory is optional; the benchmark goes on without it
        return []


def run_job(job: dict[str, Any], workdir: Path, vllm: Any) -> dict[str, Any]:
    requests = job["requests"]
    t0 = time.perf_counter()
    llm = vllm.LLM(**job["llm_kwargs"])
    startup = time.perf_counter() - t0

    def params(max_tokens: int) -> Any:
        return vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    for req in requests[: job.get("warmup", 0)]:
        images = [_load_image(s, workdir, mirrored=True) for s in req["images"]]
        llm.generate([_prompt(req["prompt_token_ids"], images)], params(2), use_tqdm=False)

    images = _load_all(requests, workdir)
    scenario = job["scenario"]
    _on_workers(llm, _reset_peak_rpc)
    if scenario == "throughput":
        records, duration = _generate_all(
            llm, [_prompt(r["prompt_token_ids"], ims) for r, ims in zip(requests, images)],
            [params(r["max_tokens"]) for r in requests], [r["request_id"] for r in requests],
            [len(ims) for ims in images])
    else:
        stepper, records = _Stepper(llm), []
        t0 = time.perf_counter()
        for req, ims in zip(requests, images):
            rid = req["request_id"] + ("/turn1" if scenario == "multiturn" else "")
            rec, final = stepper.run(rid, _prompt(req["prompt_token_ids"], ims), params(req["max_tokens"]), len(ims))
            records.append(rec)
            if scenario == "multiturn" and final is not None:
                # the conversation so far (prompt before image expansion, the answer) plus the follow-up question
                follow = list(req["prompt_token_ids"]) + list(final.outputs[0].token_ids) + req["follow_up_token_ids"]
                rec2, _ = stepper.run(req["request_id"] + "/turn2", _prompt(follow, ims), params(req["max_tokens"]),
                                      len(ims))
                records.append(rec2)
        duration = time.perf_counter() - t0
    peaks = [p for p in _on_workers(llm, _peak_memory_rpc) if p is not None]
    return {"vllm_version": getattr(vllm, "__version__", None), "startup_s": startup, "records": records,
            "duration_s": duration, "peak_memory_bytes": max(peaks) if peaks else None,
            "resolved": _resolved(llm)}


def _resolved(llm: Any) -> dict[str, Any]:
    """What vLLM derived at start-up (scheduler limits, KV blocks, graphs), as far as this version exposes it."""
    out: dict[str, Any] = {}
    try:
        config = llm.llm_engine.vllm_config
    except Exception:  # noqa: BLE001
        return out
    for section, names in (("scheduler_config", ("max_num_seqs", "max_num_batched_tokens")),
                           ("cache_config", ("block_size", "num_gpu_blocks", "enable_prefix_caching")),
                           ("model_config", ("max_model_len", "dtype")),
                           ("compilation_config", ("mode", "cudagraph_mode"))):
        part = getattr(config, section, None)
        for name in names:
            value = getattr(part, name, None)
            if value is not None:
                out[name] = value if isinstance(value, (int, float, bool, str)) else str(value)
    return out


def main(argv: list[str]) -> int:
    workdir = Path(argv[0])
    # Run as a script, this file's folder heads sys.path; nothing there may shadow what vLLM imports.
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        import vllm

        vllm.LLM, vllm.SamplingParams  # noqa: B018 - vLLM imports these lazily: "imports" must cover them
    except Exception as e:  # noqa: BLE001 - any failure to import is what the parent must report
        _write_json(workdir / "error.json", {"stage": "import", "error": f"{type(e).__name__}: {e}",
                                             "python": sys.executable})
        return EXIT_IMPORT
    if "--probe" in argv[1:]:
        _write_json(workdir / "probe.json", {"vllm_version": getattr(vllm, "__version__", None),
                                             "python": sys.executable})
        return 0
    try:
        result = run_job(json.loads((workdir / "job.json").read_text()), workdir, vllm)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()  # into the log the parent keeps
        _write_json(workdir / "error.json", {"stage": "run", "error": f"{type(e).__name__}: {e}",
                                             "traceback": traceback.format_exc()})
        return EXIT_RUN
    _write_json(workdir / "result.json", result)
    return 0


if __name__ == "__main__":  # vLLM may start its engine core with multiprocessing 'spawn': keep work under main
    sys.exit(main(sys.argv[1:]))
