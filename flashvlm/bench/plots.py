"""Small PNG plots for benchmark reports: latency CDFs, stage breakdown bars, throughput vs concurrency, and
(from bench/timeline.py) the step timeline of throughput runs.

Every function takes runs as ScenarioResult objects or their `to_dict()` form, writes one ~600x400 PNG,
and returns the paths written: [] when there is nothing to draw, so a report never fails for lack of data.
Figures are built with matplotlib's object API and saved through the Agg canvas, never through pyplot,
so no global backend is switched and no GUI window can open, even when called from a notebook or a server.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashvlm.bench.records import STAGES
from flashvlm.bench.timeline import step_timeline

__all__ = ["latency_cdf", "stage_breakdown", "throughput_vs_concurrency", "report_plots", "run_names", "as_dict"]

FIGSIZE = (6.0, 4.0)
DPI = 100

_METRICS: dict[str, tuple[str, str]] = {
    # metric -> (record field, axis label); values are seconds in records, plotted in ms.
    "ttft": ("ttft", "TTFT"),
    "tpot": ("tpot", "TPOT"),
    "e2el": ("e2e", "E2E latency"),
    "itl": ("itl", "inter-token latency"),
}


def as_dict(run: Any) -> dict[str, Any]:
    """A run as the plain dict results.json stores (ScenarioResult or already a dict)."""
    return run.to_dict() if hasattr(run, "to_dict") else dict(run)


def run_names(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """A display name per run: its label, qualified by scenario (then by index) only where labels collide,
    so the common single-scenario report stays terse while a latency+throughput file stays unambiguous."""
    labels = [str(r.get("label", "")) or f"run{i}" for i, r in enumerate(runs)]
    names = [lab if labels.count(lab) == 1 else f"{r.get('scenario', '?')}/{lab}" for r, lab in zip(runs, labels)]
    return [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]


def _new_figure(nrows: int = 1) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    axes = fig.subplots(nrows, 1, squeeze=False)[:, 0]
    return fig, axes


def _save(fig: Any, path: str | Path) -> list[Path]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return [path]


def _latencies_ms(run: Mapping[str, Any], metric: str) -> list[float]:
    field = _METRICS[metric][0]
    out: list[float] = []
    for rec in run.get("records") or []:
        if not rec.get("success", True):
            continue
        value = rec.get(field)
        # ITL is a list per request; pooling every gap matches how the summary's itl_ms is defined.
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, (int, float)) and math.isfinite(v):
                out.append(v * 1e3)
    return out


def latency_cdf(runs: Sequence[Any], metric: str = "ttft", path: str | Path = "latency_cdf.png") -> list[Path]:
    """Empirical CDF of one latency metric ("ttft", "tpot", "e2el" or "itl"), one line per run."""
    if metric not in _METRICS:
        raise ValueError(f"unknown latency metric {metric!r}; choose from {', '.join(_METRICS)}")
    dicts = [as_dict(r) for r in runs]
    series = [(name, sorted(_latencies_ms(r, metric))) for name, r in zip(run_names(dicts), dicts)]
    series = [(name, vals) for name, vals in series if vals]
    if not series:
        return []
    fig, (ax,) = _new_figure()
    for name, vals in series:
        n = len(vals)
        # Start each curve at 0 so the first sample reads as a rise, not as a line floating at 1/n.
        ax.step([vals[0], *vals], [0.0, *((i + 1) / n for i in range(n))], where="post", label=f"{name} (n={n})")
    lo = min(v[0] for _, v in series)
    hi = max(v[-1] for _, v in series)
    # A baseline can be 10-100x slower than the engine; a log axis keeps both curves readable.
    if lo > 0 and hi / lo > 50:
        ax.set_xscale("log")
    for q in (0.5, 0.99):
        ax.axhline(q, color="0.75", linewidth=0.8, linestyle="--", zorder=0)
    label = _METRICS[metric][1]
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of token gaps")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{label} CDF (dashed: P50, P99)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    return _save(fig, path)


def _stage_order(stage_dicts: Sequence[Mapping[str, Any]]) -> list[str]:
    present = {s for d in stage_dicts for s in d}
    return [s for s in STAGES if s in present] + sorted(present - set(STAGES))


def stage_breakdown(runs: Sequence[Any], path: str | Path = "stage_breakdown.png") -> list[Path]:
    """Top: stacked horizontal bars of mean ms per stage, one bar per run. Bottom: P99 ms per stage,
    grouped by run, since tails do not add up the way means do and stacking them would mislead."""
    dicts = [as_dict(r) for r in runs]
    rows = [(name, (r.get("summary") or {}).get("stages_ms") or {}) for name, r in zip(run_names(dicts), dicts)]
    rows = [(name, st) for name, st in rows if any((v or {}).get("mean") is not None for v in st.values())]
    if not rows:
        return []
    stages = _stage_order([st for _, st in rows])
    fig, (top, bottom) = _new_figure(nrows=2)
    colors = {s: f"C{i % 10}" for i, s in enumerate(stages)}
    ys = list(range(len(rows)))
    left = [0.0] * len(rows)
    for stage in stages:
        widths = [float((st.get(stage) or {}).get("mean") or 0.0) for _, st in rows]
        top.barh(ys, widths, left=left, color=colors[stage], label=stage, height=0.6)
        left = [a + b for a, b in zip(left, widths)]
    top.set_yticks(ys, [name for name, _ in rows], fontsize="small")
    top.invert_yaxis()
    top.set_xlabel("mean time per request (ms)")
    top.set_title("Per-stage time (mean, stacked)")
    # Outside the axes: inside, it would hide the short bars it is meant to explain.
    top.legend(fontsize="x-small", loc="center left", bbox_to_anchor=(1.0, 0.5), title="stage",
               title_fontsize="x-small")
    top.grid(True, axis="x", alpha=0.3)

    width = 0.8 / len(rows)
    for i, (name, st) in enumerate(rows):
        p99 = [float((st.get(s) or {}).get("p99") or 0.0) for s in stages]
        bottom.bar([j + (i - (len(rows) - 1) / 2) * width for j in range(len(stages))], p99, width=width,
                   label=name)
    bottom.set_xticks(range(len(stages)), stages, fontsize="x-small")
    bottom.set_ylabel("P99 (ms)")
    bottom.set_title("Per-stage P99")
    bottom.grid(True, axis="y", alpha=0.3)
    if len(rows) > 1:
        bottom.legend(fontsize="x-small")
    return _save(fig, path)


def throughput_vs_concurrency(points: Sequence[Mapping[str, Any]],
                              path: str | Path = "throughput_vs_concurrency.png") -> list[Path]:
    """Output tok/s against concurrency, one line per label; points are {label, concurrency, output_throughput}."""
    series: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        c, t = p.get("concurrency"), p.get("output_throughput")
        if isinstance(c, (int, float)) and isinstance(t, (int, float)) and c > 0:
            series.setdefault(str(p.get("label", "")), []).append((float(c), float(t)))
    if not series:
        return []
    fig, (ax,) = _new_figure()
    for label, pts in series.items():
        pts.sort()
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=label)
    cs = [c for pts in series.values() for c, _ in pts]
    # Concurrency sweeps are usually powers of two; a log2 axis spaces them evenly.
    if max(cs) / min(cs) >= 8:
        ax.set_xscale("log", base=2)
    ticks = sorted(set(cs))
    ax.set_xticks(ticks, [f"{c:g}" for c in ticks])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output throughput (tok/s)")
    ax.set_ylim(bottom=0)
    ax.set_title("Output throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


def _concurrency_points(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    points = []
    for r in runs:
        where = [r.get("workload") or {}, r.get("config") or {}]
        conc = next((w[k] for w in where for k in ("concurrency", "max_concurrency") if w.get(k)), None)
        points.append({"label": r.get("label"), "concurrency": conc,
                       "output_throughput": (r.get("summary") or {}).get("output_throughput")})
    return points


def report_plots(runs: Sequence[Any], plot_dir: str | Path) -> list[Path]:
    """Every plot a report shows for these runs, written under plot_dir: TTFT/TPOT/E2E CDFs, the stage
    breakdown, throughput vs concurrency where runs carry a `concurrency`/`max_concurrency` setting, and the
    step timeline of each throughput run with step records."""
    dicts = [as_dict(r) for r in runs]
    plot_dir = Path(plot_dir)
    written: list[Path] = []
    for metric in ("ttft", "tpot", "e2el"):
        written += latency_cdf(dicts, metric, plot_dir / f"{metric}_cdf.png")
    written += stage_breakdown(dicts, plot_dir / "stage_breakdown.png")
    points = _concurrency_points(dicts)
    # One point is not a curve; only draw when some label was measured at two or more concurrencies.
    if any(len({p["concurrency"] for p in points if p["label"] == lab and p["concurrency"]}) > 1
           for lab in {p["label"] for p in points}):
        written += throughput_vs_concurrency(points, plot_dir / "throughput_vs_concurrency.png")
    names = run_names(dicts)
    timed = [(name, r) for name, r in zip(names, dicts) if r.get("scenario") == "throughput" and r.get("steps")]
    for name, r in timed:  # one file per run: step_timeline.png, or one suffixed by run name when several
        suffix = "" if len(timed) == 1 else "_" + re.sub(r"[^A-Za-z0-9.+-]+", "_", name)
        written += step_timeline(r["steps"], plot_dir / f"step_timeline{suffix}.png", title=name)
    return written
