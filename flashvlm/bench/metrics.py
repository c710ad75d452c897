"""Aggregate metrics of a benchmark run, defined the way `vllm bench serve` defines them so figures compare.

- TTFT: time from sending a request to its first output chunk.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1), so a request's prefill is not charged to its decode
  speed; requests with one output token have none.
- ITL: every gap between consecutive output chunks, pooled over all requests (a chunk may carry several
  tokens, which is why ITL and TPOT can differ).
- E2E latency (e2el): send to last token.

Only successful requests enter latencies, throughputs and goodput; failed ones are only counted.
Latencies come out in milliseconds, throughputs per second of `duration_s`; None marks "undefined".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from flashvlm.bench.records import STAGES, RequestRecord, ScenarioResult
from flashvlm.bench.timeline import summarize_steps

GOODPUT_KEYS = ("ttft", "tpot", "e2el")
"""SLO names accepted by `--goodput`, in milliseconds (vLLM's names)."""

RATIO_METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("ttft_p50_ms", ("ttft_ms", "p50"), False),
    ("ttft_p99_ms", ("ttft_ms", "p99"), False),
    ("tpot_p50_ms", ("tpot_ms", "p50"), False),
    ("output_throughput", ("output_throughput",), True),
    ("peak_memory_gb", ("peak_memory_gb",), False),
)
"""(column name, path into a summary, higher is better) of the metrics `ratio_table` compares."""


def _pkey(p: float) -> str:
    return f"p{p:g}"


def percentiles(values: Iterable[float], ps: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    """{"mean", "p50", "p90", "p99", "min", "max"} (one "pX" per entry of ps) with numpy's linear interpolation,
    as vLLM reports them; every value None for empty input."""
    arr = np.asarray(list(values), dtype=np.float64)
    keys = ["mean", *(_pkey(p) for p in ps), "min", "max"]
    if arr.size == 0:
        return dict.fromkeys(keys)
    out: dict[str, float | None] = {"mean": float(arr.mean())}
    for p, q in zip(ps, np.percentile(arr, list(ps))):
        out[_pkey(p)] = float(q)
    out["min"] = float(arr.min())
    out["max"] = float(arr.max())
    return out


def _ms(values: Iterable[float | None]) -> list[float]:
    return [v * 1e3 for v in values if v is not None]


def _per_second(amount: float, duration_s: float) -> float | None:
    return amount / duration_s if duration_s > 0 else None


def stage_breakdown(records: Sequence[RequestRecord]) -> dict[str, dict[str, float | None]]:
    """Per stage present in the records: mean/p50/p99 in ms and the share of E2E.

    A stage's share is taken over the requests that report that stage (mean stage time / mean E2E of those
    same requests), so an engine that reports a stage for only some requests is not diluted by the others.
    """
    present = {s for r in records for s in r.stages}
    # Pipeline order first, then any stage an engine adds that STAGES does not know, for a stable layout.
    order = [s for s in STAGES if s in present] + sorted(present - set(STAGES))
    out: dict[str, dict[str, float | None]] = {}
    for stage in order:
        having = [r for r in records if stage in r.stages]
        times = percentiles(_ms(r.stages[stage] for r in having), ps=(50, 99))
        e2e = _ms(r.e2e for r in having)
        mean_e2e = sum(e2e) / len(e2e) if e2e else None
        share = times["mean"] / mean_e2e if mean_e2e else None
        out[stage] = {"mean": times["mean"], "p50": times["p50"], "p99": times["p99"], "share": share}
    return out


def bottleneck(stages_ms: Mapping[str, Mapping[str, float | None]]) -> str | None:
    """The stage with the largest share of E2E (largest mean time if no share is known); None without stages."""
    if not stages_ms:
        return None
    with_share = {s: v["share"] for s, v in stages_ms.items() if v.get("share") is not None}
    scores = with_share or {s: v.get("mean") or 0.0 for s, v in stages_ms.items()}
    return max(scores, key=lambda s: scores[s])


def _check_slos(slos: Mapping[str, float]) -> None:
    unknown = sorted(set(slos) - set(GOODPUT_KEYS))
    if unknown:
        raise ValueError(f"unknown goodput SLO(s) {unknown}; valid keys: {', '.join(GOODPUT_KEYS)}")


def is_good(record: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a successful request meets every SLO (ms). A missing TPOT passes: a one-token answer has no
    decode phase to judge (vLLM counts its TPOT as 0); a missing TTFT or E2E fails, since it was not met."""
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2e}
    for key, limit_ms in slos.items():
        value = values[key]
        if value is None:
            if key == "tpot":
                continue
            return False
        if value * 1e3 > limit_ms:
            return False
    return True


def summarize(result: ScenarioResult, goodput_slos: Mapping[str, float] | None = None) -> dict[str, Any]:
    """Aggregate a run's records into the summary dict `results.json` stores; also sets `result.summary`."""
    records = result.records
    ok = [r for r in records if r.success]
    duration = result.duration_s
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    stages = stage_breakdown(ok)

    goodput: dict[str, Any] | None = None
    if goodput_slos:
        _check_slos(goodput_slos)
        good = sum(is_good(r, goodput_slos) for r in ok)
        goodput = {"slos_ms": dict(goodput_slos), "good_requests": good,
                   "req_per_s": _per_second(good, duration),
                   "fraction": good / len(ok) if ok else None}

    summary: dict[str, Any] = {
        "num_requests": len(records),
        "num_success": len(ok),
        "num_errors": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": _per_second(len(ok), duration),
        "output_throughput": _per_second(out_tokens, duration),
        "total_token_throughput": _per_second(in_tokens + out_tokens, duration),
        "ttft_ms": percentiles(_ms(r.ttft for r in ok)),
        "tpot_ms": percentiles(_ms(r.tpot for r in ok)),
        "itl_ms": percentiles(gap * 1e3 for r in ok for gap in r.itl),
        "e2el_ms": percentiles(_ms(r.e2e for r in ok)),
        "stages_ms": stages,
        "bottleneck": bottleneck(stages),
        "goodput": goodput,
        "peak_memory_gb": result.peak_memory_bytes / 1e9 if result.peak_memory_bytes is not None else None,
    }
    if result.steps:
        summary["step_timeline"] = summarize_steps(result.steps, duration)
    counted = [r for r in ok if r.image_tokens is not None]
    if counted:  # what visual-token pruning left of the images
        total, kept = sum(r.image_tokens for r in counted), sum(r.image_tokens_kept or 0 for r in counted)
        summary["image_tokens"] = {"total": total, "kept": kept, "kept_fraction": kept / total if total else None}
    result.summary = summary
    return summary


def parse_goodput(spec: Sequence[str] | str) -> dict[str, float]:
    """`--goodput ttft:500 tpot:50 e2el:2000` -> {"ttft": 500.0, ...} in ms. Items may also be comma-joined."""
    items = spec.split() if isinstance(spec, str) else list(spec)
    slos: dict[str, float] = {}
    for item in (part for chunk in items for part in chunk.split(",") if part.strip()):
        key, sep, value = item.strip().partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"--goodput item {item!r} is not KEY:MS (e.g. ttft:500)")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput item {item!r}: unknown metric {key!r}; valid: {', '.join(GOODPUT_KEYS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput item {item!r}: {value.strip()!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"--goodput item {item!r}: the SLO must be a positive, finite number of milliseconds")
        if key in slos:
            raise ValueError(f"--goodput gives {key!r} twice")
        slos[key] = ms
    return slos


def _lookup(summary: Mapping[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = summary
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def ratio_table(rows: Sequence[Mapping[str, Any]], baseline_index: int = 0) -> list[dict[str, Any]]:
    """Compare each summary (a dict with "label" plus `summarize`'s keys) with the baseline row.

    Convention: every ratio is a speedup, > 1 means better than the baseline. Throughput is x / base;
    latencies and memory, where lower is better, are base / x. A ratio is None where either side is missing
    or the denominator is not positive. Rows keep their input order; each output row is
    {"label", "baseline": bool, "values": {metric: value}, "ratios": {metric: ratio}} with metric names
    from RATIO_METRICS.
    """
    if not rows:
        return []
    if not -len(rows) <= baseline_index < len(rows):
        raise IndexError(f"baseline_index {baseline_index} is out of range for {len(rows)} rows")
    base_i = baseline_index % len(rows)
    base = rows[base_i]
    table = []
    for i, row in enumerate(rows):
        values = {name: _lookup(row, path) for name, path, _ in RATIO_METRICS}
        ratios = {}
        for name, path, higher_is_better in RATIO_METRICS:
            x, b = values[name], _lookup(base, path)
            ratios[name] = _ratio(x, b) if higher_is_better else _ratio(b, x)
        table.append({"label": str(row.get("label", f"row{i}")), "baseline": i == base_i,
                      "values": values, "ratios": ratios})
    return table
