"""`flashvlm bench --video FRAMESxWxH`: one seeded synthetic video per request, run by the offline scenarios
against the transformers baseline; bad specs and unsupported combinations are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from flashvlm.bench.records import BenchRequest
from flashvlm.bench.report import load_results
from flashvlm.bench.video_workload import add_videos, parse_video_spec
from flashvlm.cli import main

VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def test_parse_video_spec() -> None:
    assert parse_video_spec("16x640x360") == (16, 360, 640)
    for bad in ("640x360", "0x640x360", "16x640", "sixteen x640x360", "16x-1x360"):
        with pytest.raises(ValueError, match="FRAMESxWIDTHxHEIGHT"):
            parse_video_spec(bad)


def test_add_videos_frames_differ_and_are_seeded() -> None:
    reqs = [BenchRequest(f"req-{i}", "text", [], 4) for i in range(2)]
    a, b = add_videos(reqs, "16x64x36", VIDEO, seed=0), add_videos(reqs, "16x64x36", VIDEO, seed=0)
    assert a[0].prompt == VIDEO + "text" and not reqs[0].videos
    frames = a[0].videos[0]
    assert len(frames) == 16 and all(f.shape == (36, 64, 3) and f.dtype == np.uint8 for f in frames)
    assert not np.array_equal(frames[0], frames[1])  # the window slides
    assert not np.array_equal(frames[0], a[1].videos[0][0])  # each request its own picture
    assert all(np.array_equal(x, y) for x, y in zip(frames, b[0].videos[0]))  # seeded
    assert not np.array_equal(frames[0], add_videos(reqs, "16x64x36", VIDEO, seed=1)[0].videos[0][0])
    with pytest.raises(ValueError, match="video input"):
        add_videos(reqs, "2x64x36", None, seed=0)


def test_video_workload_against_the_transformers_baseline(tmp_path) -> None:
    out = tmp_path / "out"
    args = ["throughput", "--num-requests", "2", "--image-size", "none", "--video", "4x56x56", "--text-tokens",
            "8", "--output-tokens", "4", "--device", "cpu", "--no-progress", "--kv-cache-tokens", "4096",
            "--baseline", "transformers"]
    assert main(["bench", *args, "--out", str(out)]) == 0
    doc = load_results(out / "results.json")
    assert [r["label"] for r in doc["runs"]] == ["transformers", "flashvlm"]
    for run in doc["runs"]:
        assert run["workload"]["video"] == "4x56x56"
        assert run["summary"]["num_success"] == 2
        assert all(r["output_tokens"] == 4 for r in run["records"])
    base, ours = ([r["prompt_tokens"] for r in run["records"]] for run in doc["runs"])
    assert base == ours and min(ours) > 8 + 2 * 4  # two temporal patches of at least 4 tokens each


@pytest.mark.parametrize("extra,match", [(["multiturn"], "multiturn"),
                                         (["latency", "--baseline", "vllm"], "vllm"),
                                         (["latency", "--video", "16by9"], "FRAMESxWIDTHxHEIGHT")])
def test_video_workload_refusals(capsys, extra, match) -> None:
    args = ["--video", "4x56x56", *extra[1:]] if "--video" not in extra else extra[1:]
    assert main(["bench", extra[0], *args, "--device", "cpu", "--no-progress", "--image-size", "none"]) == 1
    assert match in capsys.readouterr().err


def test_warm_up_does_not_seed_the_caches_with_the_video() -> None:
    from flashvlm import LLM
    from flashvlm.bench.scenarios import warm_up
    from flashvlm.models.default import default_model_path

    llm = LLM(str(default_model_path()), device="cpu", kv_cache_tokens=4096)
    reqs = add_videos([BenchRequest("req-0", "what happens?", [], 2)], "4x56x56", VIDEO, seed=0)
    warm_up(llm, reqs)
    out = llm.generate(reqs[0].engine_prompt())[0]
    assert out.num_cached_tokens == 0
    assert llm.engine.stats()["encoder_cache_hits"] == 0
    assert llm.generate(reqs[0].engine_prompt())[0].num_cached_tokens > 0  # the check can see a hit
