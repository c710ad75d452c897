"""`--baseline vllm`: the parent/child protocol against a test double of vLLM's offline API (a tiny `vllm` package
written to a temp dir and put on the worker's PYTHONPATH), the clear errors when vLLM does not import or the model
is not one it runs, and the bench command end to end with both rows in results.json."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from flashvlm.bench.baselines.vllm_baseline import (
    INPUTS_NOTE,
    VLLMBaseline,
    VLLMBaselineError,
    check_architecture,
    vllm_llm_kwargs,
    worker_env,
)
from flashvlm.bench.records import BenchRequest, RequestRecord, ScenarioResult
from flashvlm.bench.report import load_results
from flashvlm.cli import main
from flashvlm.models.default import default_model_path

FAKE_VLLM = '''
"""A test double of vLLM's offline API: deterministic tokens, RequestStateStats-like metrics, and a dump of
everything it was given (FAKE_VLLM_DUMP, one JSON object a line)."""
import json
import os
import time

__version__ = "0.0.fake"


def _dump(**entry):
    with open(os.environ["FAKE_VLLM_DUMP"], "a") as f:
        f.write(json.dumps(entry) + "\\n")


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class _Stats:
    def __init__(self, arrival_time):
        self.arrival_time, self.first_token_latency = arrival_time, 0.0
        self.queued_ts = self.scheduled_ts = time.monotonic()
        self.first_token_ts = self.last_token_ts = 0.0


class _Completion:
    def __init__(self):
        self.token_ids, self.finish_reason = [], None


class RequestOutput:
    def __init__(self, request_id, prompt_token_ids, arrival_time):
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.outputs, self.finished, self.metrics = [_Completion()], False, _Stats(arrival_time)


def _images(prompt):
    images = prompt.get("multi_modal_data", {}).get("image", [])
    return images if isinstance(images, list) else [images]


def _sizes(prompt):
    return [list(im.size) for im in _images(prompt)]


def _pixel_sums(prompt):
    import numpy as np

    return [int(np.asarray(im.convert("RGB"), dtype=np.int64).sum()) for im in _images(prompt)]


class _Engine:
    def __init__(self):
        self.active = []

    def add_request(self, request_id, prompt, params, arrival_time=None):
        _dump(kind="request", via="engine", request_id=request_id, prompt_token_ids=prompt["prompt_token_ids"],
              image_sizes=_sizes(prompt), pixel_sums=_pixel_sums(prompt), max_tokens=params.max_tokens,
              ignore_eos=params.ignore_eos, temperature=params.temperature)
        # vLLM expands each image placeholder; the double adds 4 tokens per image
        ids = list(prompt["prompt_token_ids"]) + [0] * (4 * len(_sizes(prompt)))
        self.active.append((RequestOutput(request_id, ids, arrival_time or time.time()), params))
        return request_id + "-internal"

    def has_unfinished_requests(self):
        return bool(self.active)

    def step(self):
        time.sleep(0.001)
        outs = []
        for out, params in self.active:
            toks = out.outputs[0].token_ids
            toks.append((sum(out.prompt_token_ids) + len(toks)) % 1000)
            stats = out.metrics
            now = time.monotonic()
            if len(toks) == 1:
                stats.first_token_latency = time.time() - stats.arrival_time
                stats.first_token_ts = now
            stats.last_token_ts = now
            if len(toks) >= params.max_tokens:
                out.finished, out.outputs[0].finish_reason = True, "length"
            outs.append(out)
        self.active = [(o, p) for o, p in self.active if not o.finished]
        return outs


class LLM:
    def __init__(self, **kwargs):
        import sys

        _dump(kind="init", kwargs=kwargs, flashvlm_imported=any(m.startswith("flashvlm") for m in sys.modules))
        if kwargs.get("fake_fail"):
            raise RuntimeError("the fake engine was told to fail")
        self.llm_engine = _Engine()

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self.llm_engine.add_request(str(i), prompt, p)
        done = {}
        while self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[str(i)] for i in range(len(prompts))]

    def collective_rpc(self, fn):
        # the engine-core worker's answer; the real function reads torch.cuda there
        return [123456789 if fn.__name__ == "_peak_memory_rpc" else None]
'''

BROKEN_VLLM = 'raise ImportError("this vllm is broken on purpose")\n'


def _package(root: Path, source: str) -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch) -> Path:
    """Puts the fake vllm on the worker's PYTHONPATH; returns the file it dumps what it received to."""
    site = _package(tmp_path / "site", FAKE_VLLM)
    dump = tmp_path / "received.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("FAKE_VLLM_DUMP", str(dump))
    return dump


def _received(dump: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, dump.read_text().splitlines()) if e["kind"] == kind]


def _tokenizer():
    from flashvlm.config import ModelConfig
    from flashvlm.models.loader import read_checkpoint

    return read_checkpoint(ModelConfig(model=str(default_model_path()))).tokenizer


def _requests() -> list[BenchRequest]:
    from flashvlm.bench.workloads import WorkloadSpec, generate_workload
    from flashvlm.models.families.qwen2_vl import QWEN2_VL

    spec = WorkloadSpec(num_requests=3, image_sizes=[(84, 112), (56, 140)], images_per_request=(1, 2),
                        text_tokens=(4, 9), output_tokens=(3, 5), repeated_image_ratio=0.3, seed=3)
    return generate_workload(spec, QWEN2_VL.image_placeholder)


def test_a_python_without_vllm_gets_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(_package(tmp_path, BROKEN_VLLM)))
    base = VLLMBaseline(str(default_model_path()), {}, python=sys.executable)
    with pytest.raises(VLLMBaselineError) as err:
        base.check()
    msg = str(err.value)
    assert f"vLLM does not import in {sys.executable}" in msg and "this vllm is broken on purpose" in msg
    assert "--baseline-python" in msg and "drop --baseline vllm" in msg


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this environment has vLLM")
def test_our_venv_without_vllm_names_the_missing_module(monkeypatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(VLLMBaselineError, match="No module named 'vllm'"):
        VLLMBaseline(str(default_model_path()), {}).check()


def test_cli_reports_a_missing_vllm_on_stderr_before_running_anything(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PYTHONPATH", str(_package(tmp_path, BROKEN_VLLM)))
    rc = main(["bench", "latency", "--num-requests", "1", "--device", "cpu", "--no-progress", "--baseline", "vllm",
               "--baseline-python", sys.executable])
    err = capsys.readouterr()
    assert rc == 1
    assert err.err.startswith("error: --baseline vllm: vLLM does not import in") and "Traceback" not in err.err
    assert "TTFT" not in err.out  # refused before our engine ran


def test_a_missing_interpreter_and_other_families_are_refused(tmp_path) -> None:
    with pytest.raises(VLLMBaselineError, match="does not exist"):
        VLLMBaseline(str(default_model_path()), {}, python=str(tmp_path / "no-python")).check()
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"]}))
    with pytest.raises(VLLMBaselineError, match="only the Qwen2-VL family.*LLaVA"):
        check_architecture(tmp_path)
    assert check_architecture(default_model_path()) == "Qwen2VLForConditionalGeneration"


def test_engine_flags_become_vllm_keywords() -> None:
    import argparse

    from flashvlm.bench.cli import build_parser

    parser = argparse.ArgumentParser()
    build_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "throughput", "--max-num-seqs", "7", "--max-num-batched-tokens", "512",
                              "--no-enable-prefix-caching", "--kv-cache-tokens", "4000", "--load-format", "dummy",
                              "--seed", "3", "--baseline", "vllm", "--baseline-vllm-kwargs", '{"max_num_seqs": 9}'])
    kw = vllm_llm_kwargs(args, "/m")
    assert kw["model"] == "/m" and kw["load_format"] == "dummy" and kw["seed"] == 3
    assert kw["max_num_batched_tokens"] == 512 and kw["enable_prefix_caching"] is False
    assert kw["num_gpu_blocks_override"] == 250 and kw["disable_log_stats"] is False
    assert kw["max_num_seqs"] == 9  # --baseline-vllm-kwargs wins
    args.baseline_vllm_kwargs = "[1]"
    with pytest.raises(VLLMBaselineError, match="JSON object"):
        vllm_llm_kwargs(args, "/m")


def test_latency_protocol_ships_the_same_ids_and_images(fake_vllm) -> None:
    requests, tok = _requests(), _tokenizer()
    base = VLLMBaseline(str(default_model_path()), {"max_num_seqs": 4})
    assert base.check() == "0.0.fake"
    reference = ScenarioResult("latency", "flashvlm", {"resolved_dtype": "torch.float32"}, {},
                               records=[RequestRecord(r.request_id, prompt_tokens=len(tok.encode(r.prompt)) + 4)
                                        for r in requests])
    result = base.run("latency", requests, {"seed": 5}, warmup=1, reference=reference, tokenizer=tok)

    assert result.label == "vllm" and result.scenario == "latency"
    assert result.config["llm_kwargs"]["dtype"] == "float32" and result.config["llm_kwargs"]["max_num_seqs"] == 4
    assert result.config["llm_kwargs"]["limit_mm_per_prompt"] == {"image": max(len(r.images) for r in requests)}
    assert result.workload["inputs"] == INPUTS_NOTE and result.config["vllm_version"] == "0.0.fake"
    (init,) = _received(fake_vllm, "init")
    assert init["kwargs"] == result.config["llm_kwargs"]
    assert init["flashvlm_imported"] is False  # the worker runs in an environment that may lack flashvlm

    sent = _received(fake_vllm, "request")
    warm, measured = sent[:1], sent[1:]
    assert warm[0]["max_tokens"] == 2
    assert [s["request_id"] for s in measured] == [r.request_id for r in requests]
    for req, got, rec in zip(requests, measured, result.records):
        assert got["prompt_token_ids"] == tok.encode(req.prompt, add_special_tokens=True)
        assert got["image_sizes"] == [[im.shape[1], im.shape[0]] for im in req.images]
        assert got["pixel_sums"] == [int(im.astype(np.int64).sum()) for im in req.images]
        assert got["max_tokens"] == req.max_tokens and got["ignore_eos"] and got["temperature"] == 0.0
        assert rec.request_id == req.request_id and rec.success and rec.num_images == len(req.images)
        assert rec.output_tokens == req.max_tokens and len(rec.itl) == req.max_tokens - 1
        assert rec.prompt_tokens == len(got["prompt_token_ids"]) + 4 * len(req.images)  # vLLM's expanded count
        assert 0 < rec.ttft <= rec.e2e and set(rec.stages) == {"queue", "prefill", "decode"}
    assert result.duration_s > 0 and result.peak_memory_bytes == 123456789
    one_image = sum(len(r.images) == 1 for r in requests)
    assert result.config["prompt_tokens_vs_reference"] == {"reference": "flashvlm", "compared": 3, "equal": one_image}


def test_throughput_and_multiturn_protocols(fake_vllm) -> None:
    requests, tok = _requests(), _tokenizer()
    base = VLLMBaseline(str(default_model_path()), {})
    result = base.run("throughput", requests, {}, warmup=0, tokenizer=tok)
    assert [r.request_id for r in result.records] == [r.request_id for r in requests]
    assert all(r.ttft is not None and r.e2e >= r.ttft and r.output_tokens == q.max_tokens
               for r, q in zip(result.records, requests))
    # a repeated image is one file, so its pixels arrive equal
    sent = _received(fake_vllm, "request")
    assert all(s["image_sizes"] == [[im.shape[1], im.shape[0]] for im in q.images] for s, q in zip(sent, requests))

    fake_vllm.write_text("")
    from flashvlm.bench.scenarios import follow_up_texts

    result = base.run("multiturn", requests, {}, warmup=0, tokenizer=tok)
    ids = [r.request_id for r in result.records]
    assert ids == [f"{r.request_id}/{t}" for r in requests for t in ("turn1", "turn2")]
    sent = _received(fake_vllm, "request")
    for i, req in enumerate(requests):
        first, second = sent[2 * i], sent[2 * i + 1]
        answer = [(sum(first["prompt_token_ids"]) + k) % 1000 for k in range(req.max_tokens)]
        question = tok.encode(" " + follow_up_texts(len(requests))[i], add_special_tokens=False)
        assert second["prompt_token_ids"] == first["prompt_token_ids"] + answer + question
        assert second["image_sizes"] == first["image_sizes"]


def test_a_failing_vllm_run_names_the_error(fake_vllm) -> None:
    base = VLLMBaseline(str(default_model_path()), {"fake_fail": True})
    with pytest.raises(VLLMBaselineError, match="vLLM failed: RuntimeError: the fake engine was told to fail") as err:
        base.run("latency", _requests()[:1], {}, tokenizer=_tokenizer())
    kept = Path(str(err.value).split("kept in ")[1].split(")")[0])
    assert "RuntimeError" in (kept / "worker.log").read_text()  # the traceback is in the log
    assert (kept / "job.json").is_file() and not (kept / "images").exists()
    shutil.rmtree(kept)


@pytest.mark.slow
def test_bench_throughput_with_the_vllm_baseline_end_to_end(fake_vllm, tmp_path) -> None:
    out = tmp_path / "out"
    args = ["bench", "throughput", "--num-requests", "3", "--image-size", "112x84", "--text-tokens", "8-16",
            "--output-tokens", "4", "--device", "cpu", "--no-progress", "--kv-cache-tokens", "4096",
            "--baseline", "vllm", "--out", str(out)]
    assert main(args) == 0
    doc = load_results(out / "results.json")
    assert [r["label"] for r in doc["runs"]] == ["vllm", "flashvlm"]
    vllm_run, ours = doc["runs"]
    assert vllm_run["summary"]["output_throughput"] > 0 and vllm_run["summary"]["num_success"] == 3
    assert vllm_run["summary"]["ratios"]["output_throughput"] == pytest.approx(1.0)  # the baseline row
    assert ours["summary"]["ratios"]["output_throughput"] is not None
    assert vllm_run["config"]["llm_kwargs"]["num_gpu_blocks_override"] == 4096 // 16
    assert vllm_run["config"]["llm_kwargs"]["dtype"] == "float32"  # what our engine resolved on the CPU
    assert "vllm" in (out / "report.md").read_text()
    assert vllm_run["config"]["prompt_tokens_vs_reference"]["compared"] == 3
    assert np.isfinite(vllm_run["summary"]["ttft_ms"]["p50"])


def test_images_cross_as_files_once_each(tmp_path) -> None:
    from PIL import Image

    from flashvlm.bench.baselines.vllm_baseline import write_requests

    rng = np.random.default_rng(0)
    shared = rng.integers(0, 256, (6, 9, 3), dtype=np.uint8)
    on_disk = tmp_path / "pic.png"
    Image.fromarray(rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)).save(on_disk)
    reqs = [BenchRequest("a", "x", [shared], 2, prompt_token_ids=[5, 6]),
            BenchRequest("b", "y", [shared, str(on_disk)], 3, prompt_token_ids=[7])]
    (tmp_path / "w").mkdir()
    rows = write_requests(tmp_path / "w", reqs, tokenizer=None)
    assert rows[0]["images"] == rows[1]["images"][:1]  # one file for the repeated picture
    assert rows[1]["images"][1] == str(on_disk.resolve())
    assert np.array_equal(np.load(tmp_path / "w" / rows[0]["images"][0]), shared)
    assert [r["prompt_token_ids"] for r in rows] == [[5, 6], [7]] and "follow_up_token_ids" not in rows[0]


def test_worker_environment_defaults_and_device() -> None:
    env = worker_env({"VLLM_USE_FLASHINFER_SAMPLER": "1", "PYTHONPATH": "/site"}, device="cuda:1")
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "1" and env["PYTHONPATH"] == "/site"  # the user's values stay
    assert env["HF_HUB_OFFLINE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert worker_env({}, device="auto")["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert worker_env({"CUDA_VISIBLE_DEVICES": "4,6"}, device="cuda:1")["CUDA_VISIBLE_DEVICES"] == "6"
    assert "CUDA_VISIBLE_DEVICES" not in worker_env({}, device="cuda")
