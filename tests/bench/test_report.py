"""results.json schema, report.md, plots, compare and the environment fingerprint, on hand-built runs."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path
from typing import Any

import pytest

from flashvlm.bench import plots, report
from flashvlm.bench.compare import compare, format_comparison, main_compare
from flashvlm.bench.records import RequestRecord, ScenarioResult, StepRecord
from flashvlm.bench.report import ResultsValidationError, load_results, validate_results, write_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _stats(p50: float | None, scale: float = 1.0) -> dict[str, float | None]:
    if p50 is None:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "min", "max"))
    v = p50 * scale
    return {"mean": v * 1.05, "p50": v, "p90": v * 1.5, "p99": v * 2.0, "min": v * 0.5, "max": v * 2.5}


def make_run(label: str = "flashvlm", scenario: str = "latency", scale: float = 1.0, n: int = 8,
             concurrency: int | None = None) -> dict[str, Any]:
    """A summarized run as ScenarioResult.to_dict() produces it; `scale` multiplies every latency."""
    records = []
    for i in range(n):
        ttft = (0.040 + 0.004 * i) * scale
        rec = RequestRecord(request_id=f"r{i}", prompt_tokens=300, output_tokens=32, num_images=1,
                            start_time=1000.0 + i, ttft=ttft, e2e=ttft + 31 * 0.010 * scale,
                            itl=[0.010 * scale] * 31,
                            stages={"queue": 0.001, "preprocess": 0.004 * scale, "vision": 0.015 * scale,
                                    "prefill": 0.020 * scale, "decode": 0.310 * scale, "detokenize": 0.001})
        records.append(rec)
    records.append(RequestRecord(request_id="bad", success=False, error="boom"))
    steps = [StepRecord(num_seqs=1, num_tokens=300, num_prefill_tokens=300, num_decode_tokens=0, num_images=1,
                        host_s=0.03, vision_s=0.015, forward_s=0.02)]
    stages = {st: {"mean": ms * scale, "p50": ms * scale, "p99": ms * scale * 1.4, "share": share}
              for st, ms, share in (("queue", 1.0, 0.003), ("preprocess", 4.0, 0.011), ("vision", 15.0, 0.041),
                                    ("prefill", 20.0, 0.055), ("decode", 310.0, 0.85), ("detokenize", 1.0, 0.003))}
    tput = 700.0 / scale
    summary = {
        "num_requests": n + 1, "num_success": n, "num_errors": 1, "duration_s": 3.0,
        "request_throughput": n / 3.0 / scale, "output_throughput": tput, "total_token_throughput": tput * 10,
        "ttft_ms": _stats(50.0, scale), "tpot_ms": _stats(10.0, scale), "itl_ms": _stats(10.0, scale),
        "e2el_ms": _stats(360.0, scale), "stages_ms": stages, "bottleneck": "decode",
        "goodput": {"slos_ms": {"ttft": 100.0, "tpot": 20.0}, "good_requests": n - 1, "req_per_s": 2.0,
                    "fraction": (n - 1) / n},
        "peak_memory_gb": 17.5,
        "floors": {"decode_floor_ms_per_token": 3.9, "prefill_floor_ms": 12.0, "bandwidth": 4.2e12,
                   "peak_flops": 7.9e14, "achieved_decode_fraction": 3.9 / (10 * scale),
                   "achieved_prefill_fraction": 12 / (50 * scale)},
    }
    workload = {"image_size": "448x448", "num_requests": n}
    if concurrency is not None:
        workload["concurrency"] = concurrency
    result = ScenarioResult(scenario=scenario, label=label, config={"cuda_graphs": label != "eager"},
                            workload=workload, records=records, steps=steps, duration_s=3.0,
                            peak_memory_bytes=17_500_000_000, summary=summary)
    return result.to_dict()


def _doc(runs: list[dict[str, Any]]) -> dict[str, Any]:
    env = {"python": "3.12.0", "platform": "test", "versions": {"torch": "2.0"}, "gpus": [{"name": "H200"}],
           "git_commit": "abc", "git_dirty": False, "cuda_available": True}
    return {"flashvlm_version": "0.1.0", "created": "2025-01-01T00:00:00+00:00", "command": ["flashvlm", "bench"],
            "environment": env, "runs": runs}


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def env() -> dict[str, Any]:
    return report.environment_fingerprint({"model": "tiny", "max_num_seqs": 8, "dtype": "float32"})


# --------------------------------------------------------------------------------------------- schema


def test_schema_is_valid_draft_2020_12() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(json.loads(report.SCHEMA_PATH.read_text()))


def test_written_results_validate_and_round_trip(tmp_path: Path, env: dict[str, Any]) -> None:
    runs = [make_run("transformers", scale=4.0), ScenarioResult(**_result_kwargs(make_run("flashvlm")))]
    path = write_results(tmp_path, runs, ["flashvlm", "bench", "latency"], env)
    assert path == tmp_path / "results.json"
    doc = load_results(path)
    assert [r["label"] for r in doc["runs"]] == ["transformers", "flashvlm"]
    assert doc["environment"]["engine_config"]["max_num_seqs"] == 8
    assert doc["runs"][1]["records"][0]["tpot"] == pytest.approx(0.010)


def _result_kwargs(run: dict[str, Any]) -> dict[str, Any]:
    """Rebuild ScenarioResult arguments from a dict, to feed write_results real dataclasses too."""
    kw = {k: v for k, v in run.items() if k not in ("records", "steps")}
    kw["records"] = [RequestRecord(**{k: v for k, v in r.items() if k != "tpot"}) for r in run["records"]]
    kw["steps"] = [StepRecord(**s) for s in run["steps"]]
    return kw


def test_nan_becomes_null_and_null_metrics_are_allowed(tmp_path: Path) -> None:
    run = make_run()
    run["summary"]["ttft_ms"] = _stats(None)
    run["summary"]["output_throughput"] = float("nan")
    run["summary"]["goodput"] = None
    run["summary"]["bottleneck"] = None
    path = write_results(tmp_path, [run], ["x"], _doc([])["environment"], with_plots=False)
    doc = json.loads(path.read_text())  # strict JSON: no NaN tokens
    assert doc["runs"][0]["summary"]["output_throughput"] is None


@pytest.mark.parametrize("use_jsonschema", [True, False])
def test_invalid_results_rejected_with_path(monkeypatch: pytest.MonkeyPatch, use_jsonschema: bool) -> None:
    if use_jsonschema:
        pytest.importorskip("jsonschema")
    else:
        # The built-in fallback must catch the same mistakes when jsonschema is not installed.
        monkeypatch.setitem(__import__("sys").modules, "jsonschema", None)
    validate_results(_doc([make_run()]))
    bad = _doc([make_run()])
    bad["runs"][0]["summary"]["ttft_ms"]["p50"] = "fast"
    del bad["runs"][0]["records"][0]["success"]
    bad["runs"][0]["steps"][0]["num_tokens"] = -1
    with pytest.raises(ResultsValidationError) as info:
        validate_results(bad)
    msg = str(info.value)
    assert "3 problem(s)" in msg
    assert "runs[0].summary.ttft_ms.p50" in msg and "'fast'" in msg
    assert "runs[0].records[0]" in msg and "success" in msg
    assert "runs[0].steps[0].num_tokens" in msg
    missing = _doc([make_run()])
    del missing["environment"]
    with pytest.raises(ResultsValidationError, match="environment"):
        validate_results(missing)


def test_write_refuses_invalid_and_writes_nothing(tmp_path: Path) -> None:
    run = make_run()
    del run["summary"]["e2el_ms"]
    with pytest.raises(ResultsValidationError, match="e2el_ms"):
        write_results(tmp_path / "out", [run], ["x"], _doc([])["environment"])
    assert not (tmp_path / "out").exists()


def test_load_results_reports_bad_json(tmp_path: Path) -> None:
    p = tmp_path / "r.json"
    p.write_text("{not json")
    with pytest.raises(ResultsValidationError, match="not valid JSON"):
        load_results(p)


# ------------------------------------------------------------------------------------- report and plots


def test_report_markdown_has_tables_bottleneck_and_plots(tmp_path: Path, env: dict[str, Any]) -> None:
    runs = [make_run("transformers", scale=4.0), make_run("flashvlm")]
    write_results(tmp_path, runs, ["flashvlm", "bench", "latency", "--baseline", "transformers"], env)
    md = (tmp_path / "report.md").read_text()
    assert "| stage | mean | P50 | P99 | share |" in md
    assert "| decode | 310 | 310 | 434 | 85.0% |" in md
    assert "**Bottleneck: decode** (85.0% of E2E)" in md
    assert "| TTFT | 52.5 | 50.0 | 75.0 | 100 | 125 |" in md
    assert "Goodput (ttft <= 100 ms, tpot <= 20 ms): 7 good requests (87.5%)" in md
    assert "Hardware floors" in md and "| decode (ms/token) | 3.90 | 10.0 | 39.0% |" in md
    # Without stored ratios the first run of the scenario is the baseline: flashvlm is 4x faster.
    assert "Ratios vs baseline" in md
    assert "| flashvlm | 4.00x | 4.00x | 4.00x | 4.00x | 1.00x |" in md
    for name in ("ttft_cdf", "tpot_cdf", "e2el_cdf", "stage_breakdown"):
        assert f"(plots/{name}.png)" in md
        w, h = _png_size(tmp_path / "plots" / f"{name}.png")
        assert (w, h) == (600, 400)
        assert 5_000 < (tmp_path / "plots" / f"{name}.png").stat().st_size < 300_000


def test_stored_ratios_win_over_computed(tmp_path: Path) -> None:
    base, fast = make_run("eager"), make_run("graphs", scale=0.5)
    base["summary"]["ratios"] = {"output_throughput": 1.0}
    fast["summary"]["ratios"] = {"output_throughput": 1.7}
    table = report.format_table([base, fast])
    assert "1.70x" in table and "tok/s x" in table


def test_format_table_columns_and_collisions() -> None:
    runs = [make_run("flashvlm", "latency"), make_run("flashvlm", "throughput", scale=2.0)]
    runs[1]["summary"]["bottleneck"] = None
    text = report.format_table(runs)
    lines = text.splitlines()
    assert lines[0].split() == ["run", "ok/reqs", "TTFT", "p50", "TTFT", "p99", "TPOT", "p50", "TPOT", "p99",
                                "E2E", "p50", "out", "tok/s", "peak", "GB", "bottleneck"]
    assert lines[2].startswith("latency/flashvlm") and "8/9" in lines[2] and lines[2].endswith("decode")
    assert lines[3].startswith("throughput/flashvlm") and lines[3].endswith("-")
    assert len({len(line) for line in lines[:2]}) == 1
    assert report.format_table([]) == "(no runs)"


def test_plots_skip_without_data(tmp_path: Path) -> None:
    empty = make_run()
    empty["records"] = []
    empty["summary"]["stages_ms"] = {}
    assert plots.latency_cdf([empty], "ttft", tmp_path / "a.png") == []
    assert plots.stage_breakdown([empty], tmp_path / "b.png") == []
    assert plots.throughput_vs_concurrency([], tmp_path / "c.png") == []
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="unknown latency metric"):
        plots.latency_cdf([empty], "bogus", tmp_path / "d.png")


def test_throughput_vs_concurrency_plot(tmp_path: Path, env: dict[str, Any]) -> None:
    points = [{"label": lab, "concurrency": c, "output_throughput": 100.0 * c ** 0.8 * k}
              for lab, k in (("flashvlm", 3.0), ("transformers", 1.0)) for c in (1, 2, 4, 8, 16)]
    (path,) = plots.throughput_vs_concurrency(points, tmp_path / "tvc.png")
    assert _png_size(path) == (600, 400)
    # write_results draws it on its own when runs carry concurrencies.
    runs = [make_run("flashvlm", "throughput", scale=1 / c, concurrency=c) for c in (1, 4, 16)]
    write_results(tmp_path / "sweep", runs, ["x"], env)
    assert (tmp_path / "sweep" / "plots" / "throughput_vs_concurrency.png").exists()
    assert "throughput_vs_concurrency.png" in (tmp_path / "sweep" / "report.md").read_text()


# -------------------------------------------------------------------------------------------- compare


def _planted(change: float) -> tuple[dict[str, Any], dict[str, Any]]:
    a = _doc([make_run("flashvlm"), make_run("flashvlm", "throughput")])
    b = copy.deepcopy(a)
    s = b["runs"][0]["summary"]
    s["ttft_ms"]["p50"] *= 1 + change
    s["output_throughput"] *= 1 - change
    return a, b


def test_compare_flags_planted_20pct_regression() -> None:
    a, b = _planted(0.20)
    rows = compare(a, b, threshold=0.1)
    bad = {(r["scenario"], r["metric"]) for r in rows if r["regression"]}
    assert bad == {("latency", "ttft_p50_ms"), ("latency", "output_throughput")}
    ttft = next(r for r in rows if r["scenario"] == "latency" and r["metric"] == "ttft_p50_ms")
    assert ttft["ratio"] == pytest.approx(1.2) and ttft["status"] == "regression"
    text = format_comparison(rows)
    assert text.count("REGRESSION") == 2 and "2 regression(s) past 10%" in text
    # The same change the other way is an improvement, not a regression.
    improved = compare(b, a, threshold=0.1)
    assert not any(r["regression"] for r in improved)
    assert {r["metric"] for r in improved if r["status"] == "improvement"} == {"ttft_p50_ms", "output_throughput"}


def test_compare_ignores_5pct_change_and_handles_missing() -> None:
    a, b = _planted(0.05)
    assert not any(r["regression"] for r in compare(a, b, threshold=0.1))
    b["runs"].pop(1)
    b["runs"][0]["summary"]["peak_memory_gb"] = None
    rows = compare(a, b)
    assert any(r["status"] == "only in a" and r["scenario"] == "throughput" for r in rows)
    mem = next(r for r in rows if r["metric"] == "peak_memory_gb")
    assert mem["status"] == "n/a" and not mem["regression"]
    with pytest.raises(ValueError):
        compare(a, b, threshold=-0.1)


def test_main_compare_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = _planted(0.20)
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert main_compare(pa, pb, 0.1) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert main_compare(pa, pa, 0.1) == 0
    assert main_compare(pa, pb, 0.5) == 0
    assert main_compare(pa, tmp_path / "missing.json", 0.1) == 2
    other = _doc([make_run("other")])
    po = tmp_path / "o.json"
    po.write_text(json.dumps(other))
    assert main_compare(pa, po, 0.1) == 2
    del other["runs"][0]["summary"]
    po.write_text(json.dumps(other))
    assert main_compare(pa, po, 0.1) == 2
    assert "summary" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- environment


def test_environment_fingerprint_keys(env: dict[str, Any]) -> None:
    for key in ("python", "platform", "cpu_count", "versions", "cuda_available", "cuda_version", "gpus",
                "driver_version", "git_commit", "git_dirty", "engine_config"):
        assert key in env, key
    assert set(env["versions"]) >= {"flashvlm", "torch", "triton", "transformers"}
    assert env["versions"]["flashvlm"]
    assert env["engine_config"] == {"model": "tiny", "max_num_seqs": 8, "dtype": "float32"}
    assert env["git_commit"] is None or len(env["git_commit"]) == 40
    json.dumps(env, allow_nan=False)


def test_environment_fingerprint_without_gpu_or_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    # No nvidia-smi, no git, no CUDA: every probe must fall back to None rather than raise.
    monkeypatch.setattr(report, "_run", lambda cmd, cwd=None: None)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = report.environment_fingerprint()
    assert env["cuda_available"] is False and env["gpus"] == [] and env["driver_version"] is None
    assert env["git_commit"] is None and env["engine_config"] is None
    validate_results({**_doc([]), "environment": env})
