"""Offline scenarios on our engine: latency (MLPerf SingleStream) and throughput (Offline).

The engine is driven step by step so every output token gets a host timestamp (TTFT, ITL) while the
engine itself reports stage times (CUDA events for device work) and per-step records.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from flashvlm.bench.records import BenchRequest, RequestRecord, ScenarioResult
from flashvlm.llm import LLM
from flashvlm.processing.feeder import OrderedFeeder
from flashvlm.processing.input_processor import ProcessedPrompt
from flashvlm.request import RequestOutput, SamplingParams

ProgressFn = Callable[[int], None]


def sampling_for(req: BenchRequest) -> SamplingParams:
    # Fixed-length greedy answers: every system does the same work whatever the random weights emit.
    return SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)


class _Tracker:
    """Client-side view of requests in flight: token arrival times per request."""

    def __init__(self) -> None:
        self.records: dict[str, RequestRecord] = {}
        self.last_token_time: dict[str, float] = {}

    def start(self, engine_id: str, bench_id: str, num_images: int, start_time: float,
              image_patches: list[int]) -> None:
        self.records[engine_id] = RequestRecord(request_id=bench_id, num_images=num_images, start_time=start_time,
                                                image_patches=image_patches)

    def observe(self, outputs: list[RequestOutput], now: float) -> list[str]:
        finished = []
        for out in outputs:
            rec = self.records.get(out.request_id)
            if rec is None:
                continue
            n = len(out.token_ids)
            if n > rec.output_tokens:
                if rec.ttft is None:
                    rec.ttft = now - rec.start_time
                else:
                    rec.itl.append(now - self.last_token_time[out.request_id])
                self.last_token_time[out.request_id] = now
                rec.output_tokens = n
            if out.finished:
                rec.e2e = now - rec.start_time
                rec.prompt_tokens = len(out.prompt_token_ids)
                rec.stages = dict(out.stages)
                rec.image_tokens, rec.image_tokens_kept = out.num_image_tokens, out.num_image_tokens_kept
                rec.success = out.finish_reason in ("stop", "length")
                if not rec.success:
                    rec.error = f"finished with {out.finish_reason}"
                finished.append(out.request_id)
        return finished


def _submit(llm: LLM, tracker: _Tracker, req: BenchRequest, start: float | None = None,
            processed: Callable[[], ProcessedPrompt] | None = None) -> str | None:
    """Preprocess (or take the result of `processed`, started at `start`) and add one request."""
    engine = llm.engine
    start = time.time() if start is None else start
    try:
        prompt = processed() if processed is not None else engine.process_prompt(req.engine_prompt())
        engine_req = engine.add_processed(prompt, sampling_for(req), arrival_time=start)
    except ValueError as e:  # InvalidRequestError and friends: recorded, the run goes on
        tracker.records[f"failed-{req.request_id}"] = RequestRecord(
            request_id=req.request_id, success=False, error=str(e), start_time=start, num_images=len(req.images))
        return None
    patches = [engine.checkpoint.family.vision_patches(it) for it in prompt.mm_items]
    tracker.start(engine_req.request_id, req.request_id, len(req.images), start, patches)
    return engine_req.request_id


def _peak_memory(device: str) -> int | None:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else None


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _result(llm: LLM, scenario: str, label: str, workload: dict, tracker: _Tracker, duration: float,
            steps: list) -> ScenarioResult:
    return ScenarioResult(scenario=scenario, label=label, config=engine_config_dict(llm), workload=workload,
                          records=list(tracker.records.values()), steps=steps, duration_s=duration,
                          peak_memory_bytes=_peak_memory(llm.engine.config.device))


def engine_config_dict(llm: LLM) -> dict[str, Any]:
    from dataclasses import asdict

    cfg = asdict(llm.engine.config)
    cfg["resolved_dtype"] = str(llm.engine.dtype)
    cfg["limits"] = asdict(llm.engine.limits)  # what the engine derived at start-up (KV blocks, max_model_len)
    graphs = llm.engine.runner.graphs
    cfg["cuda_graphs"] = None if graphs is None else {
        "batch_sizes": graphs.sizes, "capture_s": graphs.capture_seconds, "memory_mb": graphs.memory_bytes / 2**20}
    return cfg


def warm_up(llm: LLM, requests: list[BenchRequest], n: int = 1) -> None:
    """Run n requests shaped like the first ones (2 output tokens) so lazy initialisation and kernel compiles
    stay out of the numbers. Their images are mirrored copies: the same sizes, but different content hashes,
    so the warm-up never seeds the prefix or encoder caches with a picture the measured run then reuses (videos
    given as frames: each frame mirrored)."""
    def mirror(im: Any) -> Any:
        return np.ascontiguousarray(im[:, ::-1]) if isinstance(im, np.ndarray) else im

    for req in requests[:n]:
        prompt = {**req.engine_prompt(), "images": [mirror(im) for im in req.images]}
        if req.videos:
            prompt["videos"] = [[mirror(f) for f in v] if isinstance(v, list) else v for v in req.videos]
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))


class _Run:
    """Bookkeeping shared by the scenarios: client-side tracker, the engine's step log, peak memory, clock."""

    def __init__(self, llm: LLM) -> None:
        self.llm, self.engine, self.tracker = llm, llm.engine, _Tracker()

    def __enter__(self) -> _Run:
        self.engine.step_log = []
        _reset_peak(self.engine.config.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.duration = time.perf_counter() - self.t0
        self.steps, self.engine.step_log = self.engine.step_log, None
        for step in self.steps:  # perf_counter instants -> seconds since the run started
            step.start_s -= self.t0

    def result(self, scenario: str, label: str, workload: dict) -> ScenarioResult:
        return _result(self.llm, scenario, label, workload, self.tracker, self.duration, self.steps)


def run_latency(llm: LLM, requests: list[BenchRequest], workload: dict, label: str = "flashvlm",
                progress: ProgressFn | None = None) -> ScenarioResult:
    """One request at a time; the next is sent when the previous finishes."""
    with _Run(llm) as run:
        for req in requests:
            rid = _submit(llm, run.tracker, req)
            while rid is not None and run.engine.has_unfinished_requests():
                run.tracker.observe(run.engine.step(), time.time())
            if progress:
                progress(1)
    return run.result("latency", label, workload)


def run_throughput(llm: LLM, requests: list[BenchRequest], workload: dict, label: str = "flashvlm",
                   progress: ProgressFn | None = None) -> ScenarioResult:
    """All requests submitted at once (MLPerf Offline); throughput over the whole run. As in `LLM.generate`
    and the server, images are preprocessed on a few threads while the engine runs the requests already added
    (in order, as each is ready); every request's clock starts at the submission of all."""
    engine = llm.engine
    jobs = [functools.partial(engine.process_prompt, req.engine_prompt()) for req in requests]
    with _Run(llm) as run:
        start = time.time()
        with OrderedFeeder(jobs, lambda k, result: _submit(llm, run.tracker, requests[k], start, result),
                           backlog=engine.waiting_work,
                           step_tokens=engine.config.scheduler.max_num_batched_tokens) as feeder:
            while not feeder.done or engine.has_unfinished_requests():
                feeder.feed(block=not engine.has_unfinished_requests())
                if engine.has_unfinished_requests():
                    done = run.tracker.observe(engine.step(), time.time())
                    if progress and done:
                        progress(len(done))
    return run.result("throughput", label, workload)


FOLLOW_UP_WORDS = ("what", "about", "the", "shape", "left", "colour", "now")


def follow_up_texts(num_requests: int) -> list[str]:
    """The follow-up question of each request of a multiturn run, seeded by the workload's size; the baselines
    ask the same ones."""
    rng = np.random.default_rng(num_requests)
    return [" ".join(rng.choice(FOLLOW_UP_WORDS, size=8)) for _ in range(num_requests)]


def run_multiturn(llm: LLM, requests: list[BenchRequest], workload: dict, label: str = "flashvlm",
                  progress: ProgressFn | None = None) -> ScenarioResult:
    """Each request, then a follow-up turn of the same conversation (its prompt, its answer and a new question,
    same images), one at a time. Records come in pairs: `<id>/turn1`, `<id>/turn2`; the follow-up's TTFT shows
    what prefix caching saves when a user asks again about the same picture."""
    tokenizer = llm.get_tokenizer()
    with _Run(llm) as run:
        for req, question in zip(requests, follow_up_texts(len(requests))):
            first = _run_one(llm, run, req, f"{req.request_id}/turn1")
            if first is not None:
                follow = list(first.prompt_token_ids) + list(first.token_ids) + tokenizer.encode(
                    " " + question, add_special_tokens=False)
                turn2 = BenchRequest(f"{req.request_id}/turn2", "", req.images, req.max_tokens,
                                     prompt_token_ids=follow)
                _run_one(llm, run, turn2, turn2.request_id)
            if progress:
                progress(1)
    return run.result("multiturn", label, workload)


def _run_one(llm: LLM, run: _Run, req: BenchRequest, record_id: str) -> RequestOutput | None:
    rid = _submit(llm, run.tracker, BenchRequest(record_id, req.prompt, req.images, req.max_tokens,
                                                 prompt_token_ids=req.prompt_token_ids))
    final = None
    while rid is not None and run.engine.has_unfinished_requests():
        outs = run.engine.step()
        run.tracker.observe(outs, time.time())
        final = next((o for o in outs if o.request_id == rid and o.finished), final)
    return final


SCENARIOS = {"latency": run_latency, "throughput": run_throughput, "multiturn": run_multiturn}
