"""Where a run's time went, step by step: a summary of the engine's step records and the step timeline plot.

Steps come as StepRecord objects or the dicts results.json stores; fields a record does not carry (files from
before they existed) count as 0. GPU busy is the step's device time (vision + language model, CUDA events);
the rest of the run's wall time the GPU spent idle: inside a step while the host scheduled, built inputs or
updated, and between steps while the benchmark loop did its own work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["step_dicts", "summarize_steps", "step_timeline"]

FIGSIZE = (10.0, 6.0)
DPI = 100

# (field read from the step, legend label, colour) of the token panel, bottom to top.
_TOKEN_KINDS = (("decode", "decode", "C0"), ("prefill_text", "prefill text", "C1"),
                ("prefill_image", "prefill image placeholders", "C2"))


def step_dicts(steps: Sequence[Any]) -> list[dict[str, Any]]:
    """Steps as plain dicts (StepRecord objects through their to_dict())."""
    return [s.to_dict() if hasattr(s, "to_dict") else dict(s) for s in steps]


def _num(step: Mapping[str, Any], key: str) -> float:
    value = step.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def _tokens(step: Mapping[str, Any], kind: str) -> float:
    image = _num(step, "num_prefill_image_tokens")
    if kind == "prefill_image":
        return image
    if kind == "prefill_text":
        return _num(step, "num_prefill_tokens") - image
    return _num(step, "num_decode_tokens")


def _device_s(step: Mapping[str, Any]) -> float:
    return _num(step, "vision_s") + _num(step, "forward_s")


def _starts(steps: Sequence[Mapping[str, Any]]) -> list[float]:
    """Each step's start in seconds since the run began; records without start times are laid end to end."""
    starts = [_num(s, "start_s") for s in steps]
    if len(steps) > 1 and not any(starts):
        return [0.0, *accumulate(_num(s, "host_s") for s in steps[:-1])]
    return starts


def _mean(values: Sequence[float]) -> float | None:
    return float(np.mean(values)) if len(values) else None


def summarize_steps(steps: Sequence[Any], duration_s: float) -> dict[str, float | None]:
    """The run's step-level figures: step counts, GPU busy / idle shares of the wall time (`duration_s`), host
    time per step (ms, P50 / P99, and the mean of each measured host phase), vision work, mean tokens per step
    by kind and the mean decode batch (over steps that decode)."""
    dicts = step_dicts(steps)
    host_ms = [_num(s, "host_s") * 1e3 for s in dicts]
    busy = sum(_device_s(s) for s in dicts)
    decode_batches = [_num(s, "num_decode_tokens") for s in dicts if _num(s, "num_decode_tokens") > 0]
    prefills = [s for s in dicts if _num(s, "num_prefill_tokens") > 0]
    share = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    busy_share = share(busy)
    out: dict[str, float | None] = {
        "num_steps": len(dicts),
        "num_decode_only_steps": sum(1 for s in dicts if _num(s, "num_prefill_tokens") == 0),
        "num_mixed_steps": sum(1 for s in prefills if _num(s, "num_decode_tokens") > 0),
        "num_vision_steps": sum(1 for s in dicts if _num(s, "num_images") > 0),
        "images_encoded": sum(_num(s, "num_images") for s in dicts),
        "image_patches": sum(_num(s, "num_image_patches") for s in dicts),
        "gpu_busy_s": busy,
        "vision_s": sum(_num(s, "vision_s") for s in dicts),
        "gpu_busy_share": busy_share,
        "gpu_idle_share": None if busy_share is None else max(0.0, 1.0 - busy_share),
        "in_step_share": share(sum(host_ms) / 1e3),
        "host_ms_p50": float(np.percentile(host_ms, 50)) if host_ms else None,
        "host_ms_p99": float(np.percentile(host_ms, 99)) if host_ms else None,
        "mean_decode_batch": _mean(decode_batches),
    }
    for key in ("schedule_s", "prepare_s", "update_s"):
        out[f"mean_{key[:-2]}_ms"] = _mean([_num(s, key) * 1e3 for s in dicts])
    for kind, _, _ in _TOKEN_KINDS:
        out[f"mean_{kind}_tokens"] = _mean([_tokens(s, kind) for s in dicts])
    return out


def _stacked_bars(ax: Any, x: Sequence[float], widths: Sequence[float],
                  series: Sequence[tuple[Sequence[float], str, str]]) -> None:
    """One bar per step from its start, as wide as the step, the series (values, label, colour) stacked."""
    base = [0.0] * len(x)
    for values, label, color in series:
        ax.bar(x, values, width=widths, bottom=base, align="edge", color=color, label=label, linewidth=0)
        base = [a + b for a, b in zip(base, values)]


def step_timeline(steps: Sequence[Any], path: str | Path, title: str = "") -> list[Path]:
    """Top: tokens per step by kind, stacked, each bar as wide as the step lasted. Bottom: per step, the GPU's
    vision and language-model time and its idle rest of the step (stacked, ms), with the measured host phases
    (schedule + inputs + update) as a line. x: seconds since the run started. [] without steps."""
    from matplotlib.figure import Figure

    dicts = step_dicts(steps)
    if not dicts:
        return []
    x = _starts(dicts)
    widths = [_num(s, "host_s") for s in dicts]
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    tokens_ax, time_ax = fig.subplots(2, 1, sharex=True)
    _stacked_bars(tokens_ax, x, widths, [([_tokens(s, kind) for s in dicts], label, color)
                                         for kind, label, color in _TOKEN_KINDS])
    tokens_ax.set_ylabel("tokens per step")
    tokens_ax.set_title(f"Step timeline{f' ({title})' if title else ''}: {len(dicts)} steps")
    # Beside the panels: inside, a legend would hide the steps it explains.
    tokens_ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    tokens_ax.grid(True, axis="y", alpha=0.3)

    vision = [_num(s, "vision_s") * 1e3 for s in dicts]
    forward = [_num(s, "forward_s") * 1e3 for s in dicts]
    idle = [max(0.0, _num(s, "host_s") * 1e3 - v - f) for s, v, f in zip(dicts, vision, forward)]
    _stacked_bars(time_ax, x, widths, [(vision, "GPU: vision", "C3"), (forward, "GPU: language model", "C0"),
                                       (idle, "GPU idle in step", "0.8")])
    host = [(_num(s, "schedule_s") + _num(s, "prepare_s") + _num(s, "update_s")) * 1e3 for s in dicts]
    if any(host):
        time_ax.plot([a + w / 2 for a, w in zip(x, widths)], host, color="k", linewidth=0.8,
                     label="host: schedule + inputs + update")
    time_ax.set_xlabel("time since the run started (s)")
    time_ax.set_ylabel("ms per step")
    time_ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    time_ax.grid(True, axis="y", alpha=0.3)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return [path]
