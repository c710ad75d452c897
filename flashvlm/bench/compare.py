"""`flashvlm bench compare a.json b.json`: the ratio b/a of key metrics per run, with regressions flagged.

Runs pair by (scenario, label); a label used twice in one scenario pairs in file order. The ratio is the raw
b/a (not a speedup), so 1.20 on TTFT means b is 20% slower and 0.80 on throughput means b lost 20%.
A change is a regression when it moves the bad way by more than the threshold: latencies and memory up by
more than `threshold`, throughputs down by more than `threshold`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["COMPARE_METRICS", "compare", "format_comparison", "main_compare"]

COMPARE_METRICS: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("ttft_p50_ms", ("ttft_ms", "p50"), False),
    ("ttft_p99_ms", ("ttft_ms", "p99"), False),
    ("tpot_p50_ms", ("tpot_ms", "p50"), False),
    ("tpot_p99_ms", ("tpot_ms", "p99"), False),
    ("e2el_p50_ms", ("e2el_ms", "p50"), False),
    ("output_throughput", ("output_throughput",), True),
    ("request_throughput", ("request_throughput",), True),
    ("peak_memory_gb", ("peak_memory_gb",), False),
)
"""(metric name, path into a run's summary, higher is better)."""


def _get(summary: Any, path: tuple[str, ...]) -> float | None:
    node = summary
    for p in path:
        node = node.get(p) if isinstance(node, Mapping) else None
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _keyed(doc: Mapping[str, Any]) -> dict[tuple[str, str, int], Mapping[str, Any]]:
    out: dict[tuple[str, str, int], Mapping[str, Any]] = {}
    seen: dict[tuple[str, str], int] = {}
    for run in doc.get("runs") or []:
        key = (str(run.get("scenario", "")), str(run.get("label", "")))
        n = seen[key] = seen.get(key, -1) + 1
        out[(*key, n)] = run
    return out


def _row(key: tuple[str, str, int], metric: str | None, a: float | None, b: float | None, higher_better: bool | None,
         threshold: float, status: str | None = None) -> dict[str, Any]:
    ratio = b / a if a is not None and b is not None and a > 0 else None
    if status is None:
        if ratio is None:
            status = "n/a"
        else:
            worse = ratio < 1 - threshold if higher_better else ratio > 1 + threshold
            better = ratio > 1 + threshold if higher_better else ratio < 1 - threshold
            status = "regression" if worse else "improvement" if better else "ok"
    return {"scenario": key[0], "label": key[1] + (f"#{key[2]}" if key[2] else ""), "metric": metric, "a": a, "b": b,
            "ratio": ratio, "higher_is_better": higher_better, "threshold": threshold, "status": status,
            "regression": status == "regression"}


def compare(a: Mapping[str, Any], b: Mapping[str, Any], threshold: float = 0.1) -> list[dict[str, Any]]:
    """One row per (paired run, metric): {scenario, label, metric, a, b, ratio (b/a), higher_is_better,
    threshold, status, regression}. status is "regression", "improvement", "ok", "n/a" (a metric missing or
    zero on either side), or "only in a" / "only in b" (one row per unpaired run, metric None, never a
    regression: a dropped scenario is visible in the table but is not a slowdown)."""
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, got {threshold}")
    runs_a, runs_b = _keyed(a), _keyed(b)
    rows: list[dict[str, Any]] = []
    for key, run_a in runs_a.items():
        run_b = runs_b.get(key)
        if run_b is None:
            rows.append(_row(key, None, None, None, None, threshold, "only in a"))
            continue
        for metric, path, higher_better in COMPARE_METRICS:
            rows.append(_row(key, metric, _get(run_a.get("summary"), path), _get(run_b.get("summary"), path),
                             higher_better, threshold))
    rows += [_row(key, None, None, None, None, threshold, "only in b") for key in runs_b if key not in runs_a]
    return rows


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.{0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 3}f}"


def format_comparison(rows: Sequence[Mapping[str, Any]]) -> str:
    """Fixed-width table of compare() rows; regressions carry a REGRESSION flag and a closing count."""
    if not rows:
        return "(no runs to compare)"
    header = ["run", "metric", "a", "b", "b/a", "change", ""]
    body = []
    for r in rows:
        ratio = r.get("ratio")
        flag = {"regression": "REGRESSION", "improvement": "improved"}.get(r["status"], "")
        if r["status"].startswith("only in"):
            flag = r["status"]
        body.append([f"{r['scenario']}/{r['label']}", r.get("metric") or "-", _num(r.get("a")), _num(r.get("b")),
                     "-" if ratio is None else f"{ratio:.3f}", "-" if ratio is None else f"{100 * (ratio - 1):+.1f}%",
                     flag])
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i in (0, 1, 6) else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    lines = [fmt(header), "  ".join("-" * w for w in widths), *(fmt(c) for c in body)]
    n = sum(bool(r.get("regression")) for r in rows)
    threshold = rows[0].get("threshold", 0.0)
    lines.append(f"\n{n} regression(s) past {100 * threshold:g}% "
                 "(latency/memory: b/a above 1 + threshold; throughput: below 1 - threshold)")
    return "\n".join(lines)


def _describe(doc: Mapping[str, Any]) -> str:
    """Where a file came from, so a ratio table between different machines or commits is read as such."""
    env = doc.get("environment") or {}
    commit = (env.get("git_commit") or "no commit")[:10] + ("+dirty" if env.get("git_dirty") else "")
    gpus = sorted({str(g.get("name")) for g in env.get("gpus") or []}) or ["no GPU"]
    torch = (env.get("versions") or {}).get("torch") or "?"
    return f"flashvlm {doc.get('flashvlm_version', '?')} {commit}, {', '.join(gpus)}, torch {torch}"


def main_compare(path_a: str | Path, path_b: str | Path, threshold: float = 0.1) -> int:
    """Print the comparison of two results.json files. Exit code: 0 no regression, 1 at least one regression,
    2 unusable input (unreadable or invalid file, negative threshold, or no run present in both files, which
    would otherwise pass CI without comparing anything)."""
    from flashvlm.bench.report import load_results

    try:
        a, b = load_results(path_a), load_results(path_b)
        rows = compare(a, b, threshold)
    except (OSError, ValueError) as e:
        print(f"flashvlm bench compare: {e}", file=sys.stderr)
        return 2
    print(f"a: {path_a} ({_describe(a)})\nb: {path_b} ({_describe(b)})\n")
    print(format_comparison(rows))
    if not any(r["metric"] for r in rows):
        print("flashvlm bench compare: no run (scenario, label) is present in both files", file=sys.stderr)
        return 2
    return 1 if any(r["regression"] for r in rows) else 0
