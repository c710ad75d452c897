"""Metric math against hand-computed cases (vLLM's definitions of TTFT, TPOT, ITL, E2E and goodput)."""

from __future__ import annotations

import pytest

from flashvlm.bench.metrics import parse_goodput, percentiles, ratio_table, summarize
from flashvlm.bench.records import RequestRecord, ScenarioResult


def _result(records: list[RequestRecord], duration_s: float = 2.0, peak: int | None = None) -> ScenarioResult:
    return ScenarioResult(scenario="latency", label="x", config={}, workload={}, records=records,
                          duration_s=duration_s, peak_memory_bytes=peak)


def _rec(rid: str, ttft: float | None, e2e: float | None, out: int, prompt: int = 100, itl: list[float] | None = None,
         success: bool = True, stages: dict[str, float] | None = None) -> RequestRecord:
    return RequestRecord(request_id=rid, success=success, prompt_tokens=prompt, output_tokens=out, ttft=ttft,
                         e2e=e2e, itl=itl or [], stages=stages or {})


def test_percentiles_hand_computed() -> None:
    # Linear interpolation at rank (n-1)*p/100: for [1,2,3,4], p90 sits at rank 2.7 -> 3 + 0.7 = 3.7.
    p = percentiles([4.0, 1.0, 3.0, 2.0])
    assert p == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97, "min": 1.0, "max": 4.0})
    assert list(p) == ["mean", "p50", "p90", "p99", "min", "max"]
    assert percentiles([5.0]) == {"mean": 5.0, "p50": 5.0, "p90": 5.0, "p99": 5.0, "min": 5.0, "max": 5.0}
    # 0..100: the p-th percentile is exactly p.
    assert percentiles(range(101), ps=(25, 99.9)) == pytest.approx(
        {"mean": 50.0, "p25": 25.0, "p99.9": 99.9, "min": 0.0, "max": 100.0})


def test_percentiles_empty_is_all_none() -> None:
    assert percentiles([]) == dict.fromkeys(["mean", "p50", "p90", "p99", "min", "max"])


def test_latency_metrics_and_throughput() -> None:
    records = [
        # TPOT = (1.0 - 0.1) / (10 - 1) = 0.1 s
        _rec("a", ttft=0.1, e2e=1.0, out=10, prompt=100, itl=[0.05, 0.15]),
        # TPOT = (1.0 - 0.2) / (5 - 1) = 0.2 s
        _rec("b", ttft=0.2, e2e=1.0, out=5, prompt=200, itl=[0.2]),
        # one output token: no TPOT, but TTFT and E2E count
        _rec("c", ttft=0.3, e2e=0.3, out=1, prompt=300),
        # failures count only as errors, never in latencies or throughput
        _rec("d", ttft=0.01, e2e=0.01, out=50, prompt=1000, itl=[9.0], success=False),
    ]
    result = _result(records, duration_s=2.0, peak=3_500_000_000)
    s = summarize(result)
    assert result.summary is s
    assert (s["num_requests"], s["num_success"], s["num_errors"]) == (4, 3, 1)
    assert s["duration_s"] == 2.0
    assert s["request_throughput"] == pytest.approx(3 / 2.0)
    assert s["output_throughput"] == pytest.approx((10 + 5 + 1) / 2.0)
    assert s["total_token_throughput"] == pytest.approx((100 + 200 + 300 + 16) / 2.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(280.0)  # rank 1.8 between 200 and 300
    assert s["tpot_ms"]["p50"] == pytest.approx(150.0)  # two values, 100 and 200
    assert (s["tpot_ms"]["min"], s["tpot_ms"]["max"]) == pytest.approx((100.0, 200.0))
    # ITL pools every gap of successful requests: 50, 150, 200
    assert s["itl_ms"]["mean"] == pytest.approx(400 / 3)
    assert s["itl_ms"]["p50"] == pytest.approx(150.0)
    assert s["itl_ms"]["max"] == pytest.approx(200.0)
    assert s["e2el_ms"]["p50"] == pytest.approx(1000.0)
    assert s["e2el_ms"]["min"] == pytest.approx(300.0)
    assert s["peak_memory_gb"] == pytest.approx(3.5)
    assert s["goodput"] is None
    assert s["stages_ms"] == {} and s["bottleneck"] is None


def test_summary_shape_and_undefined_values() -> None:
    s = summarize(_result([_rec("a", None, None, 0, success=False)], duration_s=0.0))
    assert set(s) == {"num_requests", "num_success", "num_errors", "duration_s", "request_throughput",
                      "output_throughput", "total_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
                      "stages_ms", "bottleneck", "goodput", "peak_memory_gb"}
    assert s["request_throughput"] is None and s["output_throughput"] is None
    assert s["ttft_ms"]["p99"] is None and s["peak_memory_gb"] is None
    g = summarize(_result([_rec("a", None, None, 0, success=False)]), {"ttft": 100})["goodput"]
    assert g["good_requests"] == 0 and g["fraction"] is None


def test_goodput_each_slo() -> None:
    slos = {"ttft": 150.0, "tpot": 150.0, "e2el": 1500.0}
    records = [
        _rec("good", ttft=0.1, e2e=1.0, out=10),      # ttft 100, tpot 100, e2el 1000
        _rec("slow_ttft", ttft=0.2, e2e=1.0, out=10),  # ttft 200 fails
        _rec("slow_tpot", ttft=0.1, e2e=1.3, out=5),   # tpot 300 fails
        _rec("slow_e2e", ttft=0.1, e2e=2.0, out=100),  # tpot ~19 ok, e2el 2000 fails
        _rec("one_token", ttft=0.1, e2e=0.1, out=1),   # tpot None passes the tpot SLO
        _rec("edge", ttft=0.125, e2e=1.5, out=2),      # exactly at the e2el limit is good; tpot 1375 fails
        _rec("failed", ttft=0.01, e2e=0.02, out=5, success=False),
    ]
    s = summarize(_result(records, duration_s=4.0), slos)
    g = s["goodput"]
    assert g["slos_ms"] == slos
    assert g["good_requests"] == 2
    assert g["req_per_s"] == pytest.approx(2 / 4.0)
    assert g["fraction"] == pytest.approx(2 / 6)
    # One SLO at a time: which requests pass shows that each key looks at the right metric.
    assert summarize(_result(records), {"ttft": 150})["goodput"]["good_requests"] == 5
    assert summarize(_result(records), {"tpot": 150})["goodput"]["good_requests"] == 4
    assert summarize(_result(records), {"e2el": 1500})["goodput"]["good_requests"] == 5
    assert summarize(_result(records), {"e2el": 1499.9})["goodput"]["good_requests"] == 4


def test_goodput_rejects_unknown_slo() -> None:
    with pytest.raises(ValueError, match="itl"):
        summarize(_result([_rec("a", 0.1, 1.0, 10)]), {"itl": 10})


def test_stage_shares_and_bottleneck() -> None:
    records = [
        _rec("a", 0.2, 1.0, 10, stages={"queue": 0.1, "prefill": 0.1, "decode": 0.8}),
        _rec("b", 0.4, 3.0, 10, stages={"queue": 0.3, "prefill": 0.1, "decode": 2.6, "vision": 0.0}),
        _rec("c", 0.1, 9.0, 10, stages={"queue": 9.0}, success=False),  # ignored: failed
    ]
    s = summarize(_result(records))
    st = s["stages_ms"]
    assert list(st) == ["queue", "vision", "prefill", "decode"]  # pipeline order
    assert st["queue"]["mean"] == pytest.approx(200.0)
    assert st["queue"]["p50"] == pytest.approx(200.0)
    assert st["queue"]["p99"] == pytest.approx(100 + 0.99 * 200)
    assert st["queue"]["share"] == pytest.approx(200 / 2000)
    assert st["decode"]["share"] == pytest.approx(1700 / 2000)
    assert st["prefill"]["share"] == pytest.approx(100 / 2000)
    # vision is reported by b only: its share is over b's E2E
    assert st["vision"]["share"] == pytest.approx(0.0)
    assert s["bottleneck"] == "decode"

    queued = [_rec("q", 0.2, 1.0, 10, stages={"queue": 0.7, "decode": 0.3})]
    assert summarize(_result(queued))["bottleneck"] == "queue"


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput("TTFT:1.5 tpot:2") == {"ttft": 1.5, "tpot": 2.0}
    assert parse_goodput(["ttft:5,e2el:9"]) == {"ttft": 5.0, "e2el": 9.0}
    assert parse_goodput([]) == {}


@pytest.mark.parametrize(("spec", "message"), [
    (["ttft500"], "KEY:MS"),
    (["itl:5"], "unknown metric 'itl'"),
    (["ttft:fast"], "not a number"),
    (["ttft:-1"], "positive"),
    (["ttft:0"], "positive"),
    (["ttft:inf"], "finite"),
    (["ttft:5", "ttft:6"], "twice"),
])
def test_parse_goodput_errors(spec: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_goodput(spec)


def _summary(label: str, ttft50: float | None, ttft99: float, tpot50: float, out_tps: float,
             mem: float | None) -> dict:
    return {"label": label, "ttft_ms": {"p50": ttft50, "p99": ttft99}, "tpot_ms": {"p50": tpot50},
            "output_throughput": out_tps, "peak_memory_gb": mem}


def test_ratio_table_speedup_convention() -> None:
    rows = [_summary("transformers", 100.0, 400.0, 20.0, 50.0, 16.0),
            _summary("flashvlm", 25.0, 100.0, 10.0, 200.0, 20.0),
            _summary("broken", None, 800.0, 40.0, 25.0, None)]
    table = ratio_table(rows)
    assert [r["label"] for r in table] == ["transformers", "flashvlm", "broken"]
    assert [r["baseline"] for r in table] == [True, False, False]
    assert table[0]["ratios"] == pytest.approx(dict.fromkeys(table[0]["ratios"], 1.0))
    fast = table[1]
    assert fast["values"]["ttft_p50_ms"] == 25.0
    assert fast["ratios"]["ttft_p50_ms"] == pytest.approx(4.0)   # base / x
    assert fast["ratios"]["ttft_p99_ms"] == pytest.approx(4.0)
    assert fast["ratios"]["tpot_p50_ms"] == pytest.approx(2.0)
    assert fast["ratios"]["output_throughput"] == pytest.approx(4.0)  # x / base
    assert fast["ratios"]["peak_memory_gb"] == pytest.approx(0.8)  # uses more memory: < 1
    slow = table[2]
    assert slow["ratios"]["ttft_p50_ms"] is None and slow["ratios"]["peak_memory_gb"] is None
    assert slow["ratios"]["output_throughput"] == pytest.approx(0.5)
    assert slow["ratios"]["tpot_p50_ms"] == pytest.approx(0.5)

    rebased = ratio_table(rows, baseline_index=1)
    assert rebased[0]["ratios"]["output_throughput"] == pytest.approx(0.25)
    assert rebased[1]["baseline"]
    assert ratio_table([]) == []
    with pytest.raises(IndexError):
        ratio_table(rows, baseline_index=3)


def test_ratio_table_on_real_summaries() -> None:
    base = summarize(_result([_rec("a", 0.2, 1.0, 11)], duration_s=1.0, peak=10**9))
    new = summarize(_result([_rec("a", 0.1, 0.6, 11)], duration_s=0.5, peak=10**9))
    table = ratio_table([{"label": "base", **base}, {"label": "new", **new}])
    assert table[1]["ratios"] == pytest.approx({"ttft_p50_ms": 2.0, "ttft_p99_ms": 2.0, "tpot_p50_ms": 1.6,
                                                "output_throughput": 2.0, "peak_memory_gb": 1.0})
