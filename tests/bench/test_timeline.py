"""The step timeline of a throughput run: its summary numbers, the plot and the report's tables, from hand-built
steps whose figures are worked out below."""

from __future__ import annotations

from pathlib import Path

import pytest

from flashvlm.bench import report, timeline
from flashvlm.bench.floors import ModelCost, RequestWork, run_floor
from flashvlm.bench.metrics import summarize
from flashvlm.bench.records import RequestRecord, ScenarioResult, StepRecord
from flashvlm.bench.report import load_results, write_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ModelCost(lm_weight_bytes=1000, lm_matmul_params=100, lm_head_params=10, num_layers=2, num_heads=2,
                 head_dim=4, kv_bytes_per_token=8, vit_matmul_params=50, vit_depth=1, vit_width=4)


def _steps() -> list[StepRecord]:
    prefill = StepRecord(num_seqs=2, num_tokens=300, num_prefill_tokens=300, num_decode_tokens=0, num_images=2,
                         host_s=0.050, vision_s=0.020, forward_s=0.020, start_s=0.010, num_prefill_image_tokens=200,
                         num_prefill_seqs=2, num_image_patches=800, schedule_s=0.001, prepare_s=0.002, update_s=0.001)
    mixed = StepRecord(num_seqs=3, num_tokens=102, num_prefill_tokens=100, num_decode_tokens=2, num_images=0,
                       host_s=0.030, vision_s=0.0, forward_s=0.020, start_s=0.070, num_prefill_seqs=1,
                       num_decode_seqs=2, schedule_s=0.001, prepare_s=0.001, update_s=0.001)
    decode = [StepRecord(num_seqs=3, num_tokens=3, num_prefill_tokens=0, num_decode_tokens=3, num_images=0,
                         host_s=0.010, vision_s=0.0, forward_s=0.008, start_s=0.100 + 0.010 * i, num_decode_seqs=3,
                         schedule_s=0.0005, prepare_s=0.0005, update_s=0.0005) for i in range(3)]
    return [prefill, mixed, *decode]


def _result() -> ScenarioResult:
    records = [RequestRecord(f"r{i}", prompt_tokens=200, output_tokens=4, ttft=0.08, e2e=0.14, itl=[0.02] * 3,
                             image_patches=[400]) for i in range(2)]
    records.append(RequestRecord("r2", prompt_tokens=100, output_tokens=4, ttft=0.1, e2e=0.14, itl=[0.01] * 3))
    result = ScenarioResult(scenario="throughput", label="flashvlm", config={}, workload={"num_requests": 3},
                            records=records, steps=_steps(), duration_s=0.2)
    summary = summarize(result)
    floor = run_floor(TINY, [RequestWork(200, 4, (400,))] * 2 + [RequestWork(100, 4)], max_num_seqs=4)
    summary["floors"] = floor.achieved(summary)
    return result


def test_summary_of_the_steps() -> None:
    t = timeline.summarize_steps(_steps(), duration_s=0.2)
    assert (t["num_steps"], t["num_decode_only_steps"], t["num_mixed_steps"], t["num_vision_steps"]) == (5, 3, 1, 1)
    assert t["gpu_busy_s"] == pytest.approx(0.040 + 0.020 + 3 * 0.008)
    assert t["gpu_busy_share"] == pytest.approx(0.42) and t["gpu_idle_share"] == pytest.approx(0.58)
    assert t["in_step_share"] == pytest.approx(0.11 / 0.2)
    assert t["host_ms_p50"] == pytest.approx(10.0) and t["host_ms_p99"] == pytest.approx(30 + 20 * 0.96)
    assert (t["images_encoded"], t["image_patches"]) == (2, 800)
    assert t["mean_prefill_text_tokens"] == pytest.approx(40.0)
    assert t["mean_prefill_image_tokens"] == pytest.approx(40.0)
    assert t["mean_decode_tokens"] == pytest.approx(11 / 5)
    assert t["mean_decode_batch"] == pytest.approx(11 / 4)
    assert t["mean_prepare_ms"] == pytest.approx((2 + 1 + 3 * 0.5) / 5)
    # Dicts from results.json, and records from before the newer fields, read the same way.
    old = [{k: v for k, v in s.to_dict().items() if k not in ("start_s", "num_prefill_image_tokens")}
           for s in _steps()]
    assert timeline.summarize_steps(old, 0.2)["mean_prefill_text_tokens"] == pytest.approx(80.0)
    assert timeline.summarize_steps([], 0.0)["gpu_busy_share"] is None


def test_report_writes_the_timeline_plot_and_tables(tmp_path: Path) -> None:
    result = _result()
    assert result.summary["step_timeline"]["gpu_busy_share"] == pytest.approx(0.42)
    env = {"python": "3.12", "platform": "test"}
    doc = load_results(write_results(tmp_path, [result], ["flashvlm", "bench", "throughput"], env))
    assert doc["runs"][0]["steps"][0]["num_prefill_image_tokens"] == 200
    png = tmp_path / "plots" / "step_timeline.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    md = (tmp_path / "report.md").read_text()
    assert "(plots/step_timeline.png)" in md
    assert "| steps (decode only / mixed / with vision) | 5 (3 / 1 / 1) |" in md
    assert "| wall time GPU busy / idle | 42.0% / 58.0% |" in md
    assert "| host ms per step P50 / P99 | 10.0 / 49.2 |" in md
    assert "| images encoded (patches) | 2 (800) |" in md
    assert "| mean tokens per step: prefill text / prefill image / decode | 40.0 / 40.0 / 2.20 |" in md
    assert "| mean decode batch (steps that decode) | 2.75 |" in md
    floors = result.summary["floors"]
    tok_s = result.summary["output_throughput"]
    assert tok_s == pytest.approx(12 / 0.2)
    fraction = tok_s / floors["floor_output_throughput"]
    assert floors["achieved_throughput_fraction"] == pytest.approx(fraction)
    assert "Workload floor of the whole run (3 requests, 12 output tokens" in md
    assert f"| achieved (measured / floor) | {100 * fraction:.1f}% |" in md
    assert "| run | scenario | ok/reqs | duration | req/s | output tok/s | total tok/s | peak GB | bottleneck | " \
           "floor tok/s | of floor |" in md
    assert "Hardware floors" not in md  # per-request floors are for the latency scenarios
    header, _, row = report.format_table([result]).splitlines()[:3]
    assert header.split()[-3:] == ["of", "floor", "bottleneck"] and f"{100 * fraction:.1f}%" in row


def test_several_throughput_runs_get_one_timeline_each(tmp_path: Path) -> None:
    runs = [_result(), _result()]
    runs[1].label = "budget 32"
    write_results(tmp_path, runs, ["x"], {"python": "3.12", "platform": "test"})
    assert sorted(p.name for p in (tmp_path / "plots").glob("step_timeline*")) == [
        "step_timeline_budget_32.png", "step_timeline_flashvlm.png"]
    assert timeline.step_timeline([], tmp_path / "none.png") == []
