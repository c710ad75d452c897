"""Plain records shared by every benchmark scenario: what one request did, and what one run measured.

Times are seconds (floats); `*_time` fields are wall-clock instants (time.time()), the rest durations.
Everything here serializes to JSON through `to_dict()`, the shape `results.json` stores.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from flashvlm.engine.stats import StepRecord

__all__ = ["STAGES", "BenchRequest", "RequestRecord", "StepRecord", "ScenarioResult"]

STAGES = ("queue", "preprocess", "vision", "prefill", "decode", "detokenize")
"""Pipeline stages of one request, in order; the per-stage breakdown reports these."""


@dataclass
class BenchRequest:
    """One request of a workload, engine-agnostic: images as numpy arrays or file paths."""

    request_id: str
    prompt: str
    """Text with one image placeholder per image already inserted, or a plain question for chat."""
    images: list[Any]
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    image_keys: list[str] = field(default_factory=list)
    """Stable ids of the images (equal keys = the same picture), for repeated-image workloads."""
    videos: list[Any] = field(default_factory=list)
    """Videos (each a list of frames, as numpy arrays, or encoded bytes), one placeholder each in the prompt."""

    def engine_prompt(self) -> dict[str, Any]:
        """The prompt dict `LLM.generate` / `InputProcessor.process` take."""
        prompt: dict[str, Any] = ({"prompt_token_ids": self.prompt_token_ids} if self.prompt_token_ids is not None
                                  else {"prompt": self.prompt})
        return {**prompt, "images": self.images, **({"videos": self.videos} if self.videos else {})}


@dataclass
class RequestRecord:
    """What the client saw of one request, plus the engine's stage times when it reports them."""

    request_id: str
    success: bool = True
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    num_images: int = 0
    start_time: float = 0.0
    """When the client sent the request (or the scenario handed it to the engine)."""
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    """Gaps between consecutive output chunks after the first (seconds)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds per pipeline stage (keys from STAGES); empty when the engine cannot report them."""
    tier: str | None = None
    image_patches: list[int] = field(default_factory=list)
    """Patches the vision tower runs for each of the request's images, as our processor resized them (the
    workload floor's vision FLOPs); empty where the system does not say."""
    image_tokens: int | None = None
    """The prompt's image tokens as the vision tower yields them; None where the system does not say."""
    image_tokens_kept: int | None = None
    """Of those, the tokens the language model saw (fewer with visual-token pruning)."""

    @property
    def tpot(self) -> float | None:
        """vLLM's definition: (E2E - TTFT) / (output tokens - 1); None for single-token outputs."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        return d


@dataclass
class ScenarioResult:
    """One scenario run (one engine configuration): records, aggregates and context."""

    scenario: str
    label: str
    """Which system/config produced it: 'flashvlm', 'transformers', or a sweep config name."""
    config: dict[str, Any]
    workload: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    duration_s: float = 0.0
    peak_memory_bytes: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    """Aggregates filled by bench.metrics.summarize (percentiles, throughput, stage shares, floors)."""

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "label": self.label, "config": self.config, "workload": self.workload,
                "duration_s": self.duration_s, "peak_memory_bytes": self.peak_memory_bytes, "summary": self.summary,
                "records": [r.to_dict() for r in self.records], "steps": [s.to_dict() for s in self.steps]}
