"""SLA tiers, the adaptive token budget, and admission control. Plain Python (no torch): the server and the
scheduler call these, and unit tests drive them with synthetic latencies.

Tiers come from YAML (default: the packaged `flashvlm/configs/sla_tiers.yaml`)::

    default_tier: silver
    tiers:
      gold:   {priority: 0, ttft_p99_ms: 500,  tpot_p99_ms: 50}
      silver: {priority: 1, ttft_p99_ms: 1500, tpot_p99_ms: 100}
      bronze: {priority: 2, ttft_p99_ms: 10000, tpot_p99_ms: 250, share: 0.5, max_batch: 64}
"""

from __future__ import annotations

import math
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

__all__ = ["SLAConfigError", "Tier", "TierConfig", "load_tiers", "parse_tiers", "AdaptiveBudgetController",
           "AdmissionController"]

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_TIER_KEYS = {"priority", "ttft_p99_ms", "tpot_p99_ms", "share", "max_batch"}


class SLAConfigError(ValueError):
    """An invalid tier file; the message names the file, the tier and the field."""


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int
    """Lower is served first."""
    ttft_p99_ms: float
    tpot_p99_ms: float
    share: float | None = None
    """Fraction of the running batch this tier may hold (0, 1]; None = no cap."""
    max_batch: int | None = None
    """Most running requests of this tier at once; None = no cap."""

    @property
    def ttft_s(self) -> float:
        return self.ttft_p99_ms / 1000.0

    @property
    def tpot_s(self) -> float:
        return self.tpot_p99_ms / 1000.0


@dataclass(frozen=True)
class TierConfig:
    tiers: tuple[Tier, ...]
    """Sorted by priority (highest-served first), then name."""
    default: str

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def resolve(self, name: str | None) -> Tier:
        """The tier called `name` (case-insensitive, as HTTP headers arrive); None -> the default tier."""
        if name is not None and not isinstance(name, str):
            raise ValueError(f"SLA tier must be a string, got {name!r}; valid tiers: {', '.join(self.names)}")
        key = self.default if name is None else name.strip().lower()
        for tier in self.tiers:
            if tier.name == key:
                return tier
        raise ValueError(f"unknown SLA tier {name!r}; valid tiers: {', '.join(self.names)}")

    def running_caps(self) -> dict[str, int]:
        """Hard caps: each tier's `max_batch` (tiers without one are absent)."""
        return {t.name: t.max_batch for t in self.tiers if t.max_batch is not None}

    def running_shares(self, max_num_seqs: int) -> dict[str, int]:
        """Soft caps: each tier's `share` of max_num_seqs (at least 1, at most its max_batch). Past its share a
        tier borrows idle slots and gives them back when a better tier within its share waits."""
        shares = {}
        for t in self.tiers:
            if t.share is not None:
                n = max(1, math.floor(t.share * max_num_seqs))
                shares[t.name] = min(n, t.max_batch) if t.max_batch is not None else n
        return shares

    def tightest_tpot_s(self, active: Iterable[str | Tier]) -> float | None:
        """The smallest TPOT target among the given tiers (names or Tiers), None if there are none."""
        targets = [(t if isinstance(t, Tier) else self.resolve(t)).tpot_s for t in active]
        return min(targets) if targets else None


def _positive_number(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise SLAConfigError(f"{where}: {field} must be a positive number, got {value!r}")
    return float(value)


def _parse_tier(name: Any, spec: Any, source: str) -> Tier:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise SLAConfigError(f"{source}: tier name {name!r} must be a non-empty string of letters, digits, _ . -")
    where = f"{source}: tier {name!r}"
    if not isinstance(spec, Mapping):
        raise SLAConfigError(f"{where}: expected a mapping of fields, got {type(spec).__name__}")
    unknown = set(spec) - _TIER_KEYS
    if unknown:
        raise SLAConfigError(f"{where}: unknown field(s) {sorted(map(str, unknown))}; "
                             f"allowed: {sorted(_TIER_KEYS)}")
    for required in ("priority", "ttft_p99_ms", "tpot_p99_ms"):
        if required not in spec:
            raise SLAConfigError(f"{where}: missing required field {required!r}")
    priority = spec["priority"]
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise SLAConfigError(f"{where}: priority must be an integer, got {priority!r}")
    share = spec.get("share")
    if share is not None:
        share = _positive_number(share, where, "share")
        if share > 1.0:
            raise SLAConfigError(f"{where}: share must be in (0, 1], got {share!r}")
    max_batch = spec.get("max_batch")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise SLAConfigError(f"{where}: max_batch must be a positive integer, got {max_batch!r}")
    return Tier(name=name.lower(), priority=priority,
                ttft_p99_ms=_positive_number(spec["ttft_p99_ms"], where, "ttft_p99_ms"),
                tpot_p99_ms=_positive_number(spec["tpot_p99_ms"], where, "tpot_p99_ms"),
                share=share, max_batch=max_batch)


def parse_tiers(data: Any, source: str = "<tiers>") -> TierConfig:
    """Validate an already-loaded tier document (see the module docstring for its shape)."""
    if not isinstance(data, Mapping):
        raise SLAConfigError(f"{source}: expected a mapping with a 'tiers' key, got {type(data).__name__}")
    unknown = set(data) - {"tiers", "default_tier"}
    if unknown:
        raise SLAConfigError(f"{source}: unknown top-level key(s) {sorted(map(str, unknown))}")
    raw = data.get("tiers")
    if not isinstance(raw, Mapping) or not raw:
        raise SLAConfigError(f"{source}: 'tiers' must be a non-empty mapping of tier name -> fields")
    tiers = [_parse_tier(name, spec, source) for name, spec in raw.items()]
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise SLAConfigError(f"{source}: tier names must be unique ignoring case, got {names}")
    tiers.sort(key=lambda t: (t.priority, t.name))
    default = data.get("default_tier")
    if default is None:
        # Untagged traffic must not jump ahead of traffic that asked for a better tier: default to the last one.
        default = tiers[-1].name
    elif not isinstance(default, str) or default.lower() not in names:
        raise SLAConfigError(f"{source}: default_tier {default!r} is not one of the tiers {names}")
    return TierConfig(tiers=tuple(tiers), default=default.lower())


def load_tiers(path: str | os.PathLike[str] | None = None) -> TierConfig:
    """Tiers from a YAML file; None -> the packaged default (gold / silver / bronze)."""
    if path is None:
        ref = resources.files("flashvlm").joinpath("configs/sla_tiers.yaml")
        source, text = "flashvlm/configs/sla_tiers.yaml", ref.read_text(encoding="utf-8")
    else:
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise SLAConfigError(f"cannot read SLA tier file {source}: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SLAConfigError(f"{source}: invalid YAML: {e}") from e
    return parse_tiers(data, source)


def _percentile(values: Iterable[float], pct: float) -> float:
    """Nearest-rank percentile: with a 32-step window P99 is the maximum, the conservative reading."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[rank - 1]


class AdaptiveBudgetController:
    """Steers the per-step token budget (max_num_batched_tokens) from measured step latency.

    Why the target is TPOT: every running request receives one token per engine step, so a step's duration is
    the inter-token latency of every request in the batch at once. Decode work per step is nearly fixed (one
    token per running sequence); what the budget changes is how many prefill tokens (chunked prefill of newly
    admitted prompts) ride along, and those inflate the step. A large budget admits prompts fast (good TTFT,
    throughput) and a small one keeps steps short (good TPOT), so the controller looks for the largest budget
    whose step latency still meets the tightest TPOT target among the tiers that are running. TTFT is the
    scheduler's business (tier priority, preemption), and it benefits from the largest budget this allows.

    Rule (AIMD, as TCP's congestion window, which converges instead of oscillating): over a sliding window of
    steps that carried decode sequences, take the P99 step latency; above `shrink_above` x target halve the
    budget, below `grow_below` x target add `grow_step` tokens, in between hold. The band between the two
    thresholds is the hysteresis: prefill cost is roughly linear in the budget, so a halving from 1.5x lands
    near 0.75x, inside the band, rather than just under the trigger. After any change the window restarts and
    `cooldown_steps` must pass, so each decision is made on latencies measured under the current budget.

    The budget stays in [min_budget, max_budget] and never below the number of decoding sequences plus
    `min_prefill_tokens` (capped at max_budget): a budget smaller than the batch would starve running requests of
    their next token, and one with no room for prefill would stop admitting anyone, so under overload every queue
    (gold's too) would grow without bound. Measured on the H200 (docs/BENCHMARKS.md, 2026-11-29): without that
    allowance the budget fell to the batch size under a 40 req/s overload and gold waited 9 s for a first token.
    A max_budget at or below decode count + min_prefill_tokens therefore pins the budget at max_budget.
    Not thread-safe: call from the engine's step loop.
    """

    def __init__(self, initial_budget: int, min_budget: int, max_budget: int, tiers: TierConfig | None = None, *,
                 window: int = 32, min_samples: int = 8, cooldown_steps: int = 8, percentile: float = 99.0,
                 shrink_above: float = 1.5, grow_below: float = 0.7, shrink_factor: float = 0.5,
                 grow_step: int = 256, min_prefill_tokens: int = 512) -> None:
        if not 1 <= min_budget <= max_budget:
            raise ValueError(f"need 1 <= min_budget <= max_budget, got {min_budget}, {max_budget}")
        if not 0 < grow_below < shrink_above:
            raise ValueError(f"need 0 < grow_below < shrink_above, got {grow_below}, {shrink_above}")
        if not 0 < shrink_factor < 1 or grow_step < 1:
            raise ValueError("need 0 < shrink_factor < 1 and grow_step >= 1")
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        if min_prefill_tokens < 0:
            raise ValueError(f"min_prefill_tokens must be >= 0, got {min_prefill_tokens}")
        self.min_prefill_tokens = min_prefill_tokens
        self.tiers = tiers if tiers is not None else load_tiers(None)
        self.min_budget = min_budget
        self.max_budget = max_budget
        self.min_samples = min_samples
        self.cooldown_steps = cooldown_steps
        self.percentile = percentile
        self.shrink_above = shrink_above
        self.grow_below = grow_below
        self.shrink_factor = shrink_factor
        self.grow_step = grow_step
        self._budget = min(max(initial_budget, min_budget), max_budget)
        self._window: deque[float] = deque(maxlen=window)
        self._steps_since_change = cooldown_steps  # the first decision needs only min_samples
        self.last_p99_s: float | None = None
        self.last_target_s: float | None = None

    @property
    def budget(self) -> int:
        return self._budget

    def update(self, step_latency_s: float, num_decode_seqs: int, active_tiers: Iterable[str | Tier]) -> int:
        """Feed one finished step; returns the budget for the next one. `active_tiers`: tiers with requests in
        the running batch (names or Tiers; an unknown name raises ValueError, since admission validated them)."""
        self._steps_since_change += 1
        floor = max(self.min_budget, min(num_decode_seqs + self.min_prefill_tokens, self.max_budget))
        self._budget = max(self._budget, floor)
        target = self.tiers.tightest_tpot_s(active_tiers)
        self.last_target_s = target
        # A step with no decoding sequence delays nobody's next token; its latency says nothing about TPOT.
        if num_decode_seqs <= 0 or target is None:
            return self._budget
        self._window.append(step_latency_s)
        if len(self._window) < self.min_samples or self._steps_since_change < self.cooldown_steps:
            return self._budget
        p99 = _percentile(self._window, self.percentile)
        self.last_p99_s = p99
        new = self._budget
        if p99 > self.shrink_above * target:
            new = max(floor, int(self._budget * self.shrink_factor))
        elif p99 < self.grow_below * target:
            new = min(self.max_budget, self._budget + self.grow_step)
        if new != self._budget:
            self._budget = new
            self._window.clear()
            self._steps_since_change = 0
        return self._budget


class AdmissionController:
    """Bounds the waiting queue so memory never grows without limit; a refused request gets a Retry-After.

    `check(num_waiting)` admits while fewer than `max_waiting` requests wait. With tiers, pass `num_ahead` (the
    waiting requests that would be served before this one: its own and higher tiers) so a gold request is not
    refused because bronze filled the queue; the total is then bounded by `hard_max_waiting` (default 2x).

    Retry-After is the time the requests ahead need to drain at the recent completion rate (requests finished
    per second over `window_s`): by then the queue the client saw has been served. Clamped to
    [min_retry_s, max_retry_s]; with no completions observed yet it is max_retry_s. Thread-safe.
    """

    def __init__(self, max_waiting: int, *, hard_max_waiting: int | None = None, window_s: float = 30.0,
                 min_retry_s: int = 1, max_retry_s: int = 30, clock: Callable[[], float] = time.monotonic) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if not 1 <= min_retry_s <= max_retry_s:
            raise ValueError(f"need 1 <= min_retry_s <= max_retry_s, got {min_retry_s}, {max_retry_s}")
        self.max_waiting = max_waiting
        self.hard_max_waiting = hard_max_waiting if hard_max_waiting is not None else 2 * max_waiting
        if self.hard_max_waiting < max_waiting:
            raise ValueError("hard_max_waiting must be >= max_waiting")
        self.window_s = window_s
        self.min_retry_s = min_retry_s
        self.max_retry_s = max_retry_s
        self._clock = clock
        self._finished: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def record_finished(self, n: int = 1) -> None:
        """Count n requests finished now (call once per finished request, or once per step with the count)."""
        if n > 0:
            with self._lock:
                self._finished.append((self._clock(), n))

    def throughput(self) -> float | None:
        """Requests finished per second over the recent window; None when none finished within it."""
        now = self._clock()
        with self._lock:
            while self._finished and self._finished[0][0] < now - self.window_s:
                self._finished.popleft()
            if not self._finished:
                return None
            count = sum(n for _, n in self._finished)
            # Span from the oldest kept completion, so a burst after an idle period is not diluted over the whole
            # window; at least 1 s so two completions a microsecond apart do not read as a huge rate.
            span = min(self.window_s, max(1.0, now - self._finished[0][0]))
        return count / span

    def check(self, num_waiting: int, num_ahead: int | None = None) -> int | None:
        """None = admit; otherwise the Retry-After in whole seconds."""
        ahead = num_waiting if num_ahead is None else num_ahead
        if ahead < self.max_waiting and num_waiting < self.hard_max_waiting:
            return None
        rate = self.throughput()
        if rate is None:
            return self.max_retry_s
        return int(min(self.max_retry_s, max(self.min_retry_s, math.ceil(max(ahead, 1) / rate))))
