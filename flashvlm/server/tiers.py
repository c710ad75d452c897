"""SLA tiers: named service levels with a scheduler priority, P99 TTFT / TPOT targets and optional caps on
their share of the running batch. Plain Python; the server resolves a request's tier, and the adaptive budget
controller (server/budget.py) steers by the tightest running tier's TPOT target.

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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

__all__ = ["SLAConfigError", "Tier", "TierConfig", "load_tiers", "parse_tiers"]

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
