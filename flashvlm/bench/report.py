"""Benchmark output: results.json (schema-checked), a Markdown report with PNG plots, and the terminal table.

results.json is the unit of reproducibility: it carries the environment fingerprint (versions, GPU, driver,
git commit, the full engine config) beside every run, so `flashvlm bench compare` can tell two files apart
by more than their numbers. Runs may be ScenarioResult objects or their `to_dict()` form. The schema check
lives in results_validation.py; its names are re-exported here.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import importlib.metadata
import json
import math
import os
import platform
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashvlm.bench import plots
from flashvlm.bench.plots import as_dict, run_names
from flashvlm.bench.results_validation import SCHEMA_PATH, ResultsValidationError, load_results, validate_results
from flashvlm.bench.timeline import summarize_steps

__all__ = ["SCHEMA_PATH", "ResultsValidationError", "environment_fingerprint", "write_results", "load_results",
           "validate_results", "format_table", "render_markdown"]

# (key, heading, higher is better, path into a summary); key names match metrics.RATIO_METRICS so ratios
# computed here and ratios the CLI stores in summary["ratios"] read the same.
_RATIO_METRICS: tuple[tuple[str, str, bool, tuple[str, ...]], ...] = (
    ("ttft_p50_ms", "TTFT p50", False, ("ttft_ms", "p50")),
    ("ttft_p99_ms", "TTFT p99", False, ("ttft_ms", "p99")),
    ("tpot_p50_ms", "TPOT p50", False, ("tpot_ms", "p50")),
    ("output_throughput", "output tok/s", True, ("output_throughput",)),
    ("peak_memory_gb", "peak memory", False, ("peak_memory_gb",)),
)


def _jsonable(obj: Any) -> Any:
    """Plain JSON values: NaN/inf become null (strict JSON has no spelling for them), numpy scalars become
    Python numbers so they pass the schema's type checks, dataclasses and paths are unfolded."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return _jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return _jsonable(obj.item())
        except (TypeError, ValueError):
            pass
    return str(obj)


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_state() -> tuple[str | None, bool | None]:
    pkg = Path(__file__).resolve().parents[1]
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=pkg)
    # An installed copy may sit inside some unrelated repository (a venv in a project); only trust git when
    # the toplevel it reports really is the checkout this package was imported from.
    if top is None or Path(top).resolve() != pkg.parent:
        return None, None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=pkg)
    # Untracked files are ignored: --out directories inside the checkout would otherwise mark every run dirty.
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=pkg)
    return commit, (bool(status) if status is not None else None)


def environment_fingerprint(engine_config: Any = None) -> dict[str, Any]:
    """What a rerun needs to match: interpreter, OS, library versions, GPUs and driver, git commit, config.
    Never raises for a missing GPU, driver, git or optional library; those fields are None instead."""
    import flashvlm

    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine() or None,
        "cpu_count": os.cpu_count(),
        "versions": {"flashvlm": flashvlm.__version__, "torch": _version("torch"), "triton": _version("triton"),
                     "transformers": _version("transformers"), "numpy": _version("numpy"),
                     "flash-attn-4": _version("flash-attn-4")},
        "cuda_available": False, "cuda_version": None, "gpus": [], "driver_version": None,
    }
    try:
        import torch

        env["cuda_version"] = torch.version.cuda
        env["cuda_available"] = bool(torch.cuda.is_available())
        for i in range(torch.cuda.device_count() if env["cuda_available"] else 0):
            props = torch.cuda.get_device_properties(i)
            env["gpus"].append({"name": props.name, "memory_gb": round(props.total_memory / 1e9, 2),
                                "capability": f"{props.major}.{props.minor}"})
    except Exception:  # a broken CUDA install must not stop a benchmark from being recorded
        pass
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]) or ""
    rows = [[c.strip() for c in line.split(",")] for line in smi.splitlines() if "," in line]
    if rows:
        env["driver_version"] = rows[0][-1]
        env["gpus"] = env["gpus"] or [{"name": r[0], "memory_gb": None, "capability": None} for r in rows]
    env["git_commit"], env["git_dirty"] = _git_state()
    env["engine_config"] = _jsonable(engine_config) if engine_config is not None else None
    return env


def _get(summary: Mapping[str, Any] | None, *path: str) -> float | None:
    node: Any = summary or {}
    for p in path:
        node = node.get(p) if isinstance(node, Mapping) else None
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _num(v: float | None, unit: str = "") -> str:
    if v is None:
        return "-"
    digits = 0 if abs(v) >= 100 else 1 if abs(v) >= 10 else 2
    return f"{v:,.{digits}f}{unit}"


def _count(v: float | None) -> str:
    return "-" if v is None else f"{round(v):,}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _ratio(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ratios(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, float | None] | None]:
    """Per run, speedups vs its baseline (> 1 = better), the convention of metrics.ratio_table.

    The CLI stores them in summary["ratios"] where it knows the baseline; without them, the first run of each
    scenario is the baseline (a sweep's first configuration, the first system of a `--baseline` run); `serve`
    rows get none."""
    if any(isinstance((r.get("summary") or {}).get("ratios"), Mapping) for r in runs):
        return [dict((r.get("summary") or {}).get("ratios") or {}) or None for r in runs]
    base: dict[Any, Any] = {}
    for r in runs:
        base.setdefault(r.get("scenario"), r.get("summary"))
    counts = Counter(r.get("scenario") for r in runs)
    out: list[dict[str, float | None] | None] = []
    for r in runs:
        row: dict[str, float | None] = {}
        for key, _, higher_better, path in _RATIO_METRICS:
            x, b = _get(r.get("summary"), *path), _get(base[r.get("scenario")], *path)
            num, den = (x, b) if higher_better else (b, x)
            row[key] = num / den if num is not None and den else None
        # Several serve rows are one run split by SLA tier, not systems to compare.
        out.append(row if counts[r.get("scenario")] > 1 and r.get("scenario") != "serve" else None)
    return out


def _fixed_width(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


def format_table(runs: Sequence[Any]) -> str:
    """The end-of-run terminal table: one line per run; latencies in ms."""
    dicts = [as_dict(r) for r in runs]
    if not dicts:
        return "(no runs)"
    ratios = _ratios(dicts)
    with_ratio = any(ratios)
    header = ["run", "ok/reqs", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50", "out tok/s", "peak GB"]
    header += ["TTFT x", "tok/s x"] if with_ratio else []
    with_floor = any(_get(r.get("summary"), "floors", "achieved_throughput_fraction") is not None for r in dicts)
    header += ["of floor"] if with_floor else []
    header += ["bottleneck"]
    rows = []
    for name, r, rat in zip(run_names(dicts), dicts, ratios):
        s = r.get("summary") or {}
        row = [name, f"{s.get('num_success', '-')}/{s.get('num_requests', '-')}",
               _num(_get(s, "ttft_ms", "p50")), _num(_get(s, "ttft_ms", "p99")), _num(_get(s, "tpot_ms", "p50")),
               _num(_get(s, "tpot_ms", "p99")), _num(_get(s, "e2el_ms", "p50")), _num(_get(s, "output_throughput")),
               _num(_get(s, "peak_memory_gb"))]
        if with_ratio:
            row += [_ratio((rat or {}).get("ttft_p50_ms")), _ratio((rat or {}).get("output_throughput"))]
        if with_floor:  # of the whole run's floor output tok/s (throughput runs)
            row += [_pct(_get(s, "floors", "achieved_throughput_fraction"))]
        rows.append([*row, str(s.get("bottleneck") or "-")])
    note = "\nlatencies in ms; 'x' columns: speedup vs baseline (>1 = better)" if with_ratio else "\nlatencies in ms"
    return _fixed_width(header, rows) + note


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    esc = lambda c: str(c).replace("|", "\\|")
    return ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(map(esc, r)) + " |" for r in rows), ""]


def _environment_md(env: Mapping[str, Any]) -> list[str]:
    versions = env.get("versions") or {}
    gpus = env.get("gpus") or []
    gpu = ", ".join(sorted({str(g.get("name")) for g in gpus})) + f" x{len(gpus)}" if gpus else "none"
    commit = env.get("git_commit")
    commit_s = "-" if not commit else commit[:12] + (" (dirty)" if env.get("git_dirty") else "")
    rows = [["Python", env.get("python", "-")], ["Platform", env.get("platform", "-")],
            ["CPUs", env.get("cpu_count", "-")], ["GPU", gpu], ["Driver", env.get("driver_version") or "-"],
            ["CUDA (torch)", env.get("cuda_version") or "-"], ["flashvlm commit", commit_s],
            *([k, v or "-"] for k, v in versions.items())]
    lines = ["## Environment", "", *_md_table(["", ""], [[str(a), str(b)] for a, b in rows])]
    if env.get("engine_config"):
        lines += ["<details><summary>Engine configuration</summary>", "", "```json",
                  json.dumps(env["engine_config"], indent=2, sort_keys=True), "```", "", "</details>", ""]
    return lines


def _run_md(name: str, run: Mapping[str, Any]) -> list[str]:
    s = run.get("summary") or {}
    scenario = str(run.get("scenario", "?"))
    lines = [f"## {name}" if name.startswith(scenario + "/") else f"## {scenario}/{name}", ""]
    if run.get("workload"):
        lines += [f"Workload: `{json.dumps(run['workload'], sort_keys=True)}`", ""]
    lat = [[label, *(_num(_get(s, key, p)) for p in ("mean", "p50", "p90", "p99", "max"))]
           for label, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms"))]
    lines += ["Latency (ms):", "", *_md_table(["metric", "mean", "P50", "P90", "P99", "max"], lat)]
    stages = s.get("stages_ms") or {}
    if stages:
        rows = [[st, _num(_get(v, "mean")), _num(_get(v, "p50")), _num(_get(v, "p99")), _pct(_get(v, "share"))]
                for st, v in stages.items()]
        lines += ["Stage breakdown (ms per request; share of mean E2E):", "",
                  *_md_table(["stage", "mean", "P50", "P99", "share"], rows)]
    neck = s.get("bottleneck")
    if neck:
        lines += [f"**Bottleneck: {neck}** ({_pct(_get(stages, neck, 'share'))} of E2E).", ""]
    good = s.get("goodput")
    if good:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in (good.get("slos_ms") or {}).items())
        lines += [f"Goodput ({slos}): {good.get('good_requests')} good requests ({_pct(_get(good, 'fraction'))}), "
                  f"{_num(_get(good, 'req_per_s'))} req/s.", ""]
    floors = s.get("floors") or {}
    if "floor_output_throughput" in floors:
        lines += _run_floor_md(floors, s)
    elif floors:
        rows = [["decode (ms/token)", _num(_get(floors, "decode_floor_ms_per_token")), _num(_get(s, "tpot_ms", "p50")),
                 _pct(_get(floors, "achieved_decode_fraction"))],
                ["prefill (ms, TTFT)", _num(_get(floors, "prefill_floor_ms")), _num(_get(s, "ttft_ms", "p50")),
                 _pct(_get(floors, "achieved_prefill_fraction"))]]
        lines += ["Hardware floors (achieved = floor / measured P50; 100% = at the hardware limit):", "",
                  *_md_table(["", "floor", "measured P50", "achieved"], rows)]
    if scenario == "throughput" and run.get("steps"):
        lines += _timeline_md(run)
    return lines


def _run_floor_md(floors: Mapping[str, Any], s: Mapping[str, Any]) -> list[str]:
    """The floor of the whole run (bench/floors.py RunFloor) beside the measured throughput."""
    def val(key: str, scale: float = 1.0, unit: str = "") -> str:
        v = _get(floors, key)
        if v is not None and 0 < abs(v * scale) < 0.1:  # a small model's floor: significant digits, not 0.00
            return f"{v * scale:.2g}{unit}"
        return _num(None if v is None else v * scale, unit)

    rows = [["FLOPs (TFLOP): prefill / vision / decode",
             f"{val('prefill_flops', 1e-12)} / {val('vision_flops', 1e-12)} / {val('decode_flops', 1e-12)}"],
            ["decode bytes (GB): weights / KV", f"{val('decode_weight_bytes', 1e-9)} / {val('decode_kv_bytes', 1e-9)}"],
            ["decode steps (fewest at max_num_seqs)",
             f"{_count(_get(floors, 'decode_steps'))} (max_num_seqs {_count(_get(floors, 'max_num_seqs'))})"],
            ["floor: FLOPs at peak + decode bytes at bandwidth",
             f"{val('compute_s')} + {val('memory_s')} = {val('floor_s', unit=' s')}"],
            ["floor output tok/s", val("floor_output_throughput")],
            ["measured output tok/s", _num(_get(s, "output_throughput"))],
            ["achieved (measured / floor)", _pct(_get(floors, "achieved_throughput_fraction"))]]
    return [f"Workload floor of the whole run ({_count(_get(floors, 'num_requests'))} requests, "
            f"{_count(_get(floors, 'output_tokens'))} output tokens; 100% = at the hardware limit):", "",
            *_md_table(["", "value"], rows)]


def _timeline_md(run: Mapping[str, Any]) -> list[str]:
    """The step timeline in numbers (bench/timeline.py), beside plots/step_timeline*.png."""
    t = summarize_steps(run.get("steps") or [], float(run.get("duration_s") or 0.0))
    rows = [["steps (decode only / mixed / with vision)",
             f"{_count(t['num_steps'])} ({_count(t['num_decode_only_steps'])} / {_count(t['num_mixed_steps'])} / "
             f"{_count(t['num_vision_steps'])})"],
            ["wall time GPU busy / idle", f"{_pct(t['gpu_busy_share'])} / {_pct(t['gpu_idle_share'])}"],
            ["wall time inside engine steps", _pct(t["in_step_share"])],
            ["host ms per step P50 / P99", f"{_num(t['host_ms_p50'])} / {_num(t['host_ms_p99'])}"],
            ["host ms per step: schedule / inputs / update",
             f"{_num(t['mean_schedule_ms'])} / {_num(t['mean_prepare_ms'])} / {_num(t['mean_update_ms'])}"],
            ["images encoded (patches)", f"{_count(t['images_encoded'])} ({_count(t['image_patches'])})"],
            ["mean tokens per step: prefill text / prefill image / decode",
             f"{_num(t['mean_prefill_text_tokens'])} / {_num(t['mean_prefill_image_tokens'])} / "
             f"{_num(t['mean_decode_tokens'])}"],
            ["mean decode batch (steps that decode)", _num(t["mean_decode_batch"])]]
    return ["Step timeline (GPU busy = vision + language-model device time from CUDA events; idle = the rest of "
            "the wall time):", "", *_md_table(["", "value"], rows)]


def render_markdown(doc: Mapping[str, Any], plot_paths: Sequence[Path] = (), out_dir: Path | None = None) -> str:
    """report.md text for a results document; plot paths are embedded relative to out_dir."""
    runs = list(doc.get("runs") or [])
    names = run_names(runs)
    env = doc.get("environment") or {}
    lines = ["# flashvlm benchmark report", "",
             f"Created {doc.get('created', '-')} with flashvlm {doc.get('flashvlm_version', '-')}.", "",
             f"Command: `{' '.join(doc.get('command') or [])}`", "", *_environment_md(env), "## Summary", ""]
    rows = []
    with_floor = any(_get(r.get("summary"), "floors", "floor_output_throughput") is not None for r in runs)
    for name, r in zip(names, runs):
        s = r.get("summary") or {}
        row = [name, str(r.get("scenario", "-")), f"{s.get('num_success', '-')}/{s.get('num_requests', '-')}",
               _num(_get(s, "duration_s"), " s"), _num(_get(s, "request_throughput")),
               _num(_get(s, "output_throughput")), _num(_get(s, "total_token_throughput")),
               _num(_get(s, "peak_memory_gb")), str(s.get("bottleneck") or "-")]
        if with_floor:
            row += [_num(_get(s, "floors", "floor_output_throughput")),
                    _pct(_get(s, "floors", "achieved_throughput_fraction"))]
        rows.append(row)
    lines += _md_table(["run", "scenario", "ok/reqs", "duration", "req/s", "output tok/s", "total tok/s", "peak GB",
                        "bottleneck", *(["floor tok/s", "of floor"] if with_floor else [])], rows)
    ratios = _ratios(runs)
    if any(ratios):
        present, known = {k for rat in ratios if rat for k in rat}, [k for k, *_ in _RATIO_METRICS]
        keys = [k for k in known if k in present] + sorted(present - set(known))
        heads = {k: h for k, h, *_ in _RATIO_METRICS}
        rows = [[n, *(_ratio(rat.get(k)) for k in keys)] for n, rat in zip(names, ratios) if rat]
        lines += ["### Ratios vs baseline (speedup: > 1 is better than the baseline row, which reads 1.00x)", "",
                  *_md_table(["run", *(heads.get(k, k) for k in keys)], rows)]
    for name, r in zip(names, runs):
        lines += _run_md(name, r)
    if plot_paths:
        lines += ["## Plots", ""]
        for p in plot_paths:
            rel = os.path.relpath(p, out_dir) if out_dir is not None else str(p)
            lines += [f"![{Path(p).stem.replace('_', ' ')}]({Path(rel).as_posix()})", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_results(out_dir: str | Path, runs: Sequence[Any], command: Sequence[str], environment: Mapping[str, Any],
                  *, comparisons: Any = None, with_plots: bool = True) -> Path:
    """Write results.json (schema-checked first: nothing is written if it fails), report.md and plots/*.png
    under out_dir; returns the results.json path."""
    import flashvlm

    out = Path(out_dir)
    doc: dict[str, Any] = {
        "flashvlm_version": flashvlm.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": [str(c) for c in command],
        "environment": _jsonable(environment),
        "runs": [_jsonable(as_dict(r)) for r in runs],
    }
    if comparisons is not None:
        doc["comparisons"] = _jsonable(comparisons)
    validate_results(doc)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    written = plots.report_plots(doc["runs"], out / "plots") if with_plots else []
    (out / "report.md").write_text(render_markdown(doc, written, out))
    return path
