"""Every `flashvlm bench` scenario runs end to end on the embedded default model, in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashvlm.bench.report import load_results
from flashvlm.cli import main
from flashvlm.testing.fake_openai_server import FakeOpenAIServer

SMALL = ["--num-requests", "3", "--image-size", "112x84", "--text-tokens", "8-16", "--output-tokens", "4",
         "--device", "cpu", "--no-progress", "--kv-cache-tokens", "4096"]


def _run(args: list[str], out) -> dict:
    assert main(["bench", *args, "--out", str(out)]) == 0
    doc = load_results(out / "results.json")  # validates against the schema
    assert (out / "report.md").read_text().startswith("# flashvlm benchmark report")
    return doc


@pytest.mark.slow
def test_latency_with_baseline(tmp_path, capsys) -> None:
    doc = _run(["latency", *SMALL, "--baseline", "transformers", "--goodput", "ttft:60000", "tpot:60000"],
               tmp_path)
    labels = [r["label"] for r in doc["runs"]]
    assert labels == ["transformers", "flashvlm"]
    ours = doc["runs"][1]
    s = ours["summary"]
    assert s["num_success"] == 3 and s["goodput"]["good_requests"] == 3
    assert s["bottleneck"] in s["stages_ms"]
    assert set(s["stages_ms"]) == {"preprocess", "queue", "vision", "prefill", "decode", "detokenize"}
    assert s["floors"]["prefill_floor_ms"] > 0 and s["floors"]["decode_floor_ms_per_token"] > 0
    assert ours["summary"]["ratios"]["ttft_p50_ms"] is not None
    assert all(r["output_tokens"] == 4 and len(r["itl"]) == 3 for r in ours["records"])
    assert doc["environment"]["versions"]["torch"]
    assert list((tmp_path / "plots").glob("*.png"))
    assert "TTFT p50" in capsys.readouterr().out


def test_throughput_and_sweep(tmp_path) -> None:
    doc = _run(["throughput", *SMALL], tmp_path / "t")
    run = doc["runs"][0]
    assert run["scenario"] == "throughput" and run["summary"]["output_throughput"] > 0
    assert sum(s["num_decode_tokens"] for s in run["steps"]) == 3 * 3  # 4 tokens each, the first from prefill
    floors = run["summary"]["floors"]  # the floor of the whole run, not per-request ones
    assert floors["num_requests"] == 3 and floors["output_tokens"] == 12 and floors["vision_flops"] > 0
    assert 0 < floors["achieved_throughput_fraction"] < 1 and "prefill_floor_ms" not in floors
    assert run["summary"]["step_timeline"]["num_steps"] == len(run["steps"])
    assert (tmp_path / "t" / "plots" / "step_timeline.png").is_file()
    configs = json.dumps([{"name": "budget-2048"}, {"name": "budget-32", "max_num_batched_tokens": 32},
                          {"name": "pool-half", "mm_token_pruning": "pool", "mm_token_keep_ratio": 0.5}])
    doc = _run(["sweep", "--configs", configs, *SMALL], tmp_path / "s")
    assert [r["label"] for r in doc["runs"]] == ["budget-2048", "budget-32", "pool-half"]
    assert doc["runs"][1]["config"]["scheduler"]["max_num_batched_tokens"] == 32
    assert doc["runs"][1]["summary"]["ratios"]["output_throughput"] is not None
    # Each record says how many image tokens the model read: all of them unpruned, half (rounded up) with pool.
    full, pruned = doc["runs"][0], doc["runs"][2]
    assert all(r["image_tokens_kept"] == r["image_tokens"] > 0 for r in full["records"])
    assert all(r["image_tokens_kept"] == -(-r["image_tokens"] // 2) for r in pruned["records"])
    assert pruned["summary"]["image_tokens"]["kept"] < full["summary"]["image_tokens"]["total"]


def test_serve_against_openai_streaming_server(tmp_path) -> None:
    with FakeOpenAIServer(tokens_per_request=6) as server:
        doc = _run(["serve", "--base-url", server.base_url, "--num-requests", "5", "--image-size", "56x56",
                    "--output-tokens", "6", "--request-rate", "1000", "--max-concurrency", "2", "--no-progress"],
                   tmp_path)
        assert len(server.received) == 5 and server.max_in_flight <= 2
    s = doc["runs"][0]["summary"]
    assert s["num_success"] == 5 and s["tpot_ms"]["p50"] is not None


def test_serve_with_a_tier_mix_reports_each_tier(tmp_path) -> None:
    with FakeOpenAIServer(tokens_per_request=4) as server:
        doc = _run(["serve", "--base-url", server.base_url, "--num-requests", "12", "--image-size", "none",
                    "--output-tokens", "4", "--tier", "gold:0.25,bronze:0.75", "--seed", "3", "--no-progress"],
                   tmp_path)
        sent = list(server.tier_headers)
    labels = [r["label"] for r in doc["runs"]]
    assert labels == ["default", "default[gold]", "default[bronze]"]
    assert set(sent) == {"gold", "bronze"}
    counts = {r["label"]: r["summary"]["num_success"] for r in doc["runs"]}
    assert counts["default"] == 12 and counts["default[gold]"] == sent.count("gold")
    assert counts["default[gold]"] + counts["default[bronze]"] == 12
    assert all("ratios" not in r["summary"] for r in doc["runs"])  # tiers of one run, not systems
    by_request = {rec["request_id"]: rec["tier"] for rec in doc["runs"][0]["records"]}
    assert sorted(by_request.values()) == sorted(sent)


def test_tier_mix_parsing() -> None:
    from flashvlm.bench.workloads import assign_tiers, parse_tier_mix

    assert parse_tier_mix("gold") == [("gold", 1.0)]
    mix = parse_tier_mix("gold:0.2, bronze:0.8")
    assert mix == [("gold", 0.2), ("bronze", 0.8)]
    assert assign_tiers(50, mix, 1) == assign_tiers(50, mix, 1) != assign_tiers(50, mix, 2)
    for bad in ("gold:0.5,bronze:0.6", "gold:x", ":0.5", "gold:0.5,gold:0.5", "gold:0"):
        with pytest.raises(ValueError, match="--tier"):
            parse_tier_mix(bad)


@pytest.fixture(scope="module")
def latency_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One latency run with repeated images, its document and results.json, for the tests that only read them."""
    out = tmp_path_factory.mktemp("latency")
    return _run(["latency", *SMALL, "--num-requests", "4", "--repeated-image-ratio", "0.5"], out), out / "results.json"


def test_compare_flags_regression(tmp_path, capsys, latency_run) -> None:
    doc, results = latency_run
    slower = json.loads(json.dumps(doc))
    run = slower["runs"][0]["summary"]
    run["ttft_ms"]["p50"] *= 1.2
    run["output_throughput"] *= 0.8
    (tmp_path / "b.json").write_text(json.dumps(slower))
    assert main(["bench", "compare", str(results), str(tmp_path / "b.json")]) == 1
    assert "REGRESSION" in capsys.readouterr().out
    assert main(["bench", "compare", str(results), str(results)]) == 0


def test_bad_workload_is_a_clear_error(capsys) -> None:
    assert main(["bench", "latency", "--image-size", "12by34", "--device", "cpu", "--no-progress"]) == 1
    assert "12by34" in capsys.readouterr().err


def test_warm_up_does_not_seed_the_caches(tmp_path) -> None:
    from flashvlm import LLM
    from flashvlm.bench.scenarios import warm_up
    from flashvlm.bench.workloads import WorkloadSpec, generate_workload
    from flashvlm.models.default import default_model_path

    llm = LLM(str(default_model_path()), device="cpu", kv_cache_tokens=4096)
    reqs = generate_workload(WorkloadSpec(num_requests=1, image_sizes=[(112, 84)]),
                             "<|vision_start|><|image_pad|><|vision_end|>")
    warm_up(llm, reqs)
    out = llm.generate(reqs[0].engine_prompt())[0]
    assert out.num_cached_tokens == 0
    assert llm.engine.stats()["encoder_cache_hits"] == 0


def test_multiturn_and_repeated_image_splits(tmp_path, latency_run) -> None:
    doc = _run(["multiturn", *SMALL], tmp_path / "m")
    run = doc["runs"][0]
    ids = [r["request_id"] for r in run["records"]]
    assert ids == [f"req-0000{i}/turn{t}" for i in range(3) for t in (1, 2)]
    turn1, turn2 = run["records"][0], run["records"][1]
    assert turn2["prompt_tokens"] > turn1["prompt_tokens"] + turn1["output_tokens"]
    assert run["summary"]["turn2_ttft_ms"]["p50"] is not None
    s = latency_run[0]["runs"][0]["summary"]
    assert s["ttft_first_image_ms"]["p50"] is not None and s["ttft_repeated_image_ms"]["p50"] is not None


@pytest.mark.slow
def test_fuyu_throughput_with_baseline(tmp_path) -> None:
    """A family without a vision tower (Fuyu's patch projection): both systems serve its prompts and the floors
    count its projection as the vision work."""
    from flashvlm.testing.tiny_checkpoints import build_fuyu

    path = build_fuyu(tmp_path / "fuyu", seed=1)
    doc = _run(["throughput", *SMALL, "--model", str(path), "--baseline", "transformers"], tmp_path / "out")
    assert [r["label"] for r in doc["runs"]] == ["transformers", "flashvlm"]
    for run in doc["runs"]:
        assert run["summary"]["num_success"] == 3 and all(r["output_tokens"] == 4 for r in run["records"])
    assert doc["runs"][1]["summary"]["floors"]["vision_flops"] > 0
