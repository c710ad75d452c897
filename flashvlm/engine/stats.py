"""Per-step statistics the engine can record (benchmarks switch it on with Engine.step_log = [])."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class StepRecord:
    """One engine step: its size and where the time went (GPU times from CUDA events)."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_images: int
    host_s: float
    """Host time of the whole step (schedule + inputs + launch + sync + update)."""
    vision_s: float
    forward_s: float
    """Device time of the language-model forward and sampling."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
