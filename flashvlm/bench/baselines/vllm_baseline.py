"""The vLLM baseline: the same seeded workload through vLLM's offline API in a subprocess, reported as a run
labelled "vllm" beside ours.

What is shared: each request's prompt token ids before image expansion (tokenized here, by our tokenizer) and its
raw images (the workload's pixels, or a dataset's image files); vLLM expands the image placeholders and
preprocesses the images itself, from the same checkpoint's preprocessor config. The subprocess
(`vllm_worker.py`, run by `--baseline-python`, default this interpreter) gets them as files: `job.json` and one
`.npy` per distinct image, and hands back request records as JSON. Engine options that vLLM also has (its
flag names are ours) go to `vllm.LLM`; `--baseline-vllm-kwargs` adds or replaces keywords.

Only the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL) is accepted: vLLM 0.24's LLaVA path does not import with the
transformers release we run, and other families were never tried; an unsupported checkpoint or a Python where
vLLM does not import is refused before any engine starts, with an error that names the cause.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from flashvlm.bench.records import BenchRequest, RequestRecord, ScenarioResult

WORKER = Path(__file__).with_name("vllm_worker.py")

SUPPORTED_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
"""Checkpoint architectures the baseline runs: those measured with vLLM 0.24 and our transformers release."""

INPUTS_NOTE = ("same prompt token ids before image expansion and same raw images; vLLM expands the image "
               "placeholders and preprocesses the images itself")
TIMING_NOTE = ("latency, multiturn: one request at a time through llm.llm_engine.step(), host time.time() stamps "
               "per token as in flashvlm's scenarios; throughput: one LLM.generate() over all requests, TTFT and "
               "E2E from vLLM's per-request stats (RequestOutput.metrics); stages: vLLM engine-core timestamps "
               "(prefill includes vision)")

WORKER_ENV_DEFAULTS = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # vLLM's FlashInfer sampler needs a package offline hosts often lack
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",  # a local checkpoint folder: nothing to fetch
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # lets the worker send vLLM's engine-core process the small function that reads peak GPU memory there
    # (vLLM refuses to pickle functions across its processes otherwise); both processes are the benchmark's own
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
"""Set in the subprocess where the user's environment leaves them unset."""

_LOG_TAIL_LINES = 25


class VLLMBaselineError(ValueError):
    """The vLLM baseline cannot run (vLLM does not import, an unsupported model, the subprocess failed). A
    ValueError, so that the command line prints it as one error line and exits nonzero."""


def check_architecture(model_path: str | Path) -> str:
    """The checkpoint's architecture, if the baseline runs it; else a VLLMBaselineError saying which do."""
    config_file = Path(model_path) / "config.json"
    try:
        architectures = json.loads(config_file.read_text()).get("architectures") or []
    except (OSError, ValueError) as e:
        raise VLLMBaselineError(f"--baseline vllm: cannot read {config_file}: {e}") from None
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if supported:
        return supported[0]
    raise VLLMBaselineError(
        f"--baseline vllm: the model is {architectures or 'of no declared architecture'}; the vLLM baseline runs "
        f"only the Qwen2-VL family ({', '.join(SUPPORTED_ARCHITECTURES)}): vLLM 0.24's LLaVA path does not import "
        "with transformers 5.17 and other families were not tried; use --baseline transformers for this model")


def vllm_llm_kwargs(args: Any, model_path: str) -> dict[str, Any]:
    """vllm.LLM keywords from our engine flags where vLLM has the same option (same names), then the user's
    --baseline-vllm-kwargs. `VLLMBaseline.run` adds dtype (the one our engine resolved) and the image limit."""
    kwargs: dict[str, Any] = {
        "model": model_path, "load_format": args.load_format, "seed": args.seed,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization, "enable_prefix_caching": args.enable_prefix_caching,
        "enforce_eager": args.enforce_eager, "block_size": args.block_size,
        "disable_log_stats": False,  # keeps RequestOutput.metrics, the throughput scenario's TTFT
    }
    if args.max_model_len is not None:
        kwargs["max_model_len"] = args.max_model_len
    if args.kv_cache_tokens is not None:  # an exact KV capacity: vLLM takes it as a block count
        kwargs["num_gpu_blocks_override"] = math.ceil(args.kv_cache_tokens / args.block_size)
    kwargs.update(parse_extra_kwargs(getattr(args, "baseline_vllm_kwargs", None)))
    return kwargs


def parse_extra_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as e:
        raise VLLMBaselineError(f"--baseline-vllm-kwargs is not JSON: {e}") from None
    if not isinstance(extra, dict):
        raise VLLMBaselineError("--baseline-vllm-kwargs must be a JSON object of vllm.LLM keywords")
    return extra


def worker_env(base: dict[str, str] | None = None, device: str = "auto") -> dict[str, str]:
    """The subprocess's environment: ours (PYTHONPATH included), plus WORKER_ENV_DEFAULTS where unset. The
    worker imports nothing of flashvlm, so it needs no path to our package. vLLM takes no device index: our
    `--device cuda:N` becomes the one GPU the subprocess sees."""
    env = dict(os.environ if base is None else base)
    for key, value in WORKER_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    kind, _, index = device.partition(":")
    if kind == "cuda" and index.isdigit():
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[int(index)] if int(index) < len(visible) else index
    return env


@dataclass
class _Workdir:
    """The files one run exchanges with the worker; kept after a failure so its log can be read."""

    path: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="flashvlm-vllm-")))

    @property
    def log(self) -> Path:
        return self.path / "worker.log"

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def log_tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-_LOG_TAIL_LINES:])

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def keep_log(self) -> None:
        """After a failure: keep the job, log and error files, drop the images (a workload's worth of pixels)."""
        shutil.rmtree(self.path / "images", ignore_errors=True)


class VLLMBaseline:
    label = "vllm"

    def __init__(self, model_path: str, llm_kwargs: dict[str, Any], python: str | None = None,
                 env: dict[str, str] | None = None, device: str = "auto", timeout_s: float | None = None) -> None:
        self.model_path = model_path
        self.architecture = check_architecture(model_path)
        self.python = python or sys.executable
        self.llm_kwargs = dict(llm_kwargs)
        self.env = worker_env(env, device)
        self.timeout_s = timeout_s
        self.vllm_version: str | None = None

    # ---- the subprocess ----------------------------------------------------------------------------
    def _run_worker(self, workdir: _Workdir, *flags: str) -> None:
        cmd = [self.python, str(WORKER), str(workdir.path), *flags]
        try:
            with workdir.log.open("w") as log:
                proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=workdir.path,
                                      timeout=self.timeout_s, check=False)
        except FileNotFoundError:
            workdir.remove()
            raise VLLMBaselineError(f"--baseline vllm: the interpreter {self.python!r} does not exist; "
                                    "give --baseline-python the python of an environment with vLLM") from None
        except PermissionError:
            workdir.remove()
            raise VLLMBaselineError(f"--baseline vllm: {self.python!r} cannot be executed") from None
        except subprocess.TimeoutExpired:
            workdir.keep_log()
            raise VLLMBaselineError(f"--baseline vllm: the vLLM worker ran past {self.timeout_s} s; its output is "
                                    f"in {workdir.log}") from None
        if proc.returncode == 0:
            return
        error = workdir.read("error.json")
        if error is not None and error.get("stage") == "import":
            workdir.remove()
            raise VLLMBaselineError(
                f"--baseline vllm: vLLM does not import in {self.python}: {error['error']}; install vllm in that "
                "environment, point --baseline-python at a Python that has it, or drop --baseline vllm")
        cause = (f"vLLM failed: {error['error']}" if error is not None else
                 f"the vLLM worker exited with status {proc.returncode} before writing its result")
        tail = workdir.log_tail()
        workdir.keep_log()
        raise VLLMBaselineError(f"--baseline vllm: {cause} (files and full log kept in {workdir.path})"
                                + (f"; the log ends:\n{tail}" if tail else ""))

    def check(self) -> str | None:
        """Import vLLM in the baseline's interpreter (a few seconds): a clear error now rather than after our own
        run. Returns vLLM's version."""
        workdir = _Workdir()
        self._run_worker(workdir, "--probe")
        probe = workdir.read("probe.json") or {}
        workdir.remove()
        self.vllm_version = probe.get("vllm_version")
        return self.vllm_version

    # ---- a scenario --------------------------------------------------------------------------------
    def run(self, scenario: str, requests: list[BenchRequest], workload: dict[str, Any], warmup: int = 1,
            reference: ScenarioResult | None = None, tokenizer: Any = None) -> ScenarioResult:
        """Run one scenario (latency, throughput or multiturn) on the workload. `reference`, our run of the same
        workload, gives the dtype and the prompt lengths (after image expansion) vLLM's are checked against.
        Prompts are tokenized by `tokenizer`, default our checkpoint's, exactly as our engine tokenizes them."""
        if scenario not in ("latency", "throughput", "multiturn"):
            raise VLLMBaselineError(f"--baseline vllm has no {scenario!r} scenario")
        if tokenizer is None:
            from flashvlm.config import ModelConfig
            from flashvlm.models.loader import read_checkpoint

            tokenizer = read_checkpoint(ModelConfig(model=self.model_path)).tokenizer
        workdir = _Workdir()
        dtype = resolved_dtype(reference) if reference is not None else "auto"
        llm_kwargs = {"dtype": dtype, "limit_mm_per_prompt": {"image": max(1, max_images(requests))},
                      **self.llm_kwargs}
        job = {"scenario": scenario, "warmup": warmup, "llm_kwargs": llm_kwargs,
               "requests": write_requests(workdir.path, requests, tokenizer, scenario == "multiturn")}
        (workdir.path / "job.json").write_text(json.dumps(job))
        print(f"vllm baseline: {len(requests)} {scenario} requests through vLLM in {self.python} "
              f"(start-up takes a minute or two; log: {workdir.log})", file=sys.stderr, flush=True)
        self._run_worker(workdir)
        out = workdir.read("result.json")
        if out is None:
            raise VLLMBaselineError(f"--baseline vllm: the worker wrote no readable result.json in {workdir.path}")
        workdir.remove()
        config = {"system": "vllm", "vllm_version": out.get("vllm_version"), "python": self.python,
                  "llm_kwargs": llm_kwargs, "resolved": out.get("resolved", {}), "startup_s": out.get("startup_s"),
                  "inputs": INPUTS_NOTE, "timing": TIMING_NOTE}
        records = to_records(out["records"])
        if reference is not None:
            config["prompt_tokens_vs_reference"] = compare_prompt_tokens(records, reference)
        return ScenarioResult(scenario=scenario, label=self.label, config=config,
                              workload={**workload, "inputs": INPUTS_NOTE}, records=records,
                              duration_s=float(out["duration_s"]), peak_memory_bytes=out.get("peak_memory_bytes"))


def prompt_token_ids(req: BenchRequest, tokenizer: Any) -> list[int]:
    """The request's token ids before image expansion, tokenized as our InputProcessor tokenizes a raw prompt."""
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    return list(tokenizer.encode(req.prompt, add_special_tokens=True))


def write_requests(workdir: Path, requests: list[BenchRequest], tokenizer: Any,
                   follow_ups: bool = False) -> list[dict[str, Any]]:
    """The requests as JSON-ready dicts, their images saved once each (a repeated image is the same file, so
    vLLM's caches see a repeat as ours do) as `.npy` under workdir; dataset image files are passed by path."""
    image_dir = workdir / "images"
    image_dir.mkdir(exist_ok=True)
    saved: dict[int, str] = {}
    questions: list[list[int]] = []
    if follow_ups:
        from flashvlm.bench.scenarios import follow_up_texts

        questions = [tokenizer.encode(" " + q, add_special_tokens=False) for q in follow_up_texts(len(requests))]
    out = []
    for i, req in enumerate(requests):
        names = []
        for image in req.images:
            if isinstance(image, (str, Path)):
                names.append(str(Path(image).resolve()))
                continue
            if id(image) not in saved:
                name = f"images/{len(saved):06d}.npy"
                np.save(workdir / name, np.ascontiguousarray(np.asarray(image, dtype=np.uint8)))
                saved[id(image)] = name
            names.append(saved[id(image)])
        entry = {"request_id": req.request_id, "prompt_token_ids": prompt_token_ids(req, tokenizer),
                 "images": names, "max_tokens": req.max_tokens}
        if follow_ups:
            entry["follow_up_token_ids"] = list(questions[i])
        out.append(entry)
    return out


_RECORD_FIELDS = {f.name for f in fields(RequestRecord)}


def to_records(rows: list[dict[str, Any]]) -> list[RequestRecord]:
    return [RequestRecord(**{k: v for k, v in row.items() if k in _RECORD_FIELDS}) for row in rows]


def max_images(requests: list[BenchRequest]) -> int:
    return max((len(r.images) for r in requests), default=0)


def compare_prompt_tokens(records: list[RequestRecord], reference: ScenarioResult) -> dict[str, Any]:
    """How many requests vLLM expanded to as many prompt tokens as the reference run did: the check that both
    systems resized every image to the same grid."""
    theirs = {r.request_id: r.prompt_tokens for r in reference.records if r.success}
    pairs = [(r.prompt_tokens, theirs[r.request_id]) for r in records if r.success and r.request_id in theirs]
    return {"reference": reference.label, "compared": len(pairs), "equal": sum(a == b for a, b in pairs)}


def resolved_dtype(result: ScenarioResult) -> str:
    """The dtype one of our runs resolved ("bfloat16"; "auto" if it recorded none), for vLLM to run the same."""
    return str(result.config.get("resolved_dtype", "auto")).removeprefix("torch.")
