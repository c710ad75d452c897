"""Prometheus metrics for the server, named like vLLM's (`vllm:` -> `flashvlm:`) so existing dashboards port over.

Every metric lives in a `CollectorRegistry` owned by one `EngineMetrics` object rather than prometheus_client's
global registry: tests, and several servers in one process, would otherwise collide on metric names.

Engine-wide state (running/waiting requests, KV usage, cache hit counts) carries only `model_name`;
per-request metrics also carry `tier` so an operator can see each SLA class against its target.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import exposition as _exposition

from flashvlm.request import RequestOutput

__all__ = ["EngineMetrics", "LATENCY_BUCKETS", "ITL_BUCKETS", "token_buckets"]

PREFIX = "flashvlm:"

# generate_latest() writes the classic 0.0.4 text format (our names need no UTF-8 escaping), and newer clients
# label CONTENT_TYPE_LATEST as version 1.0.0, which Prometheus 2.x scrapers do not know; name the format we write.
CONTENT_TYPE = getattr(_exposition, "CONTENT_TYPE_PLAIN_0_0_4", CONTENT_TYPE_LATEST)

LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0,
)
"""Request-level durations (TTFT, E2E, stages): 1 ms to 60 s."""

ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0,
)
"""Per-token gaps sit in the 5-100 ms range on a GPU, so the low end is finer than LATENCY_BUCKETS."""

# Stage key of RequestOutput.stages -> histogram name suffix.
_STAGE_METRICS: dict[str, str] = {
    "preprocess": "request_preprocess_time_seconds",
    "queue": "request_queue_time_seconds",
    "vision": "request_vision_encode_time_seconds",
    "prefill": "request_prefill_time_seconds",
    "decode": "request_decode_time_seconds",
    "detokenize": "request_detokenize_time_seconds",
}

# Cumulative engine counters (stats key -> counter name suffix without `_total`).
_CUMULATIVE: dict[str, str] = {
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "encoder_cache_hits": "encoder_cache_hits",
    "encoder_cache_misses": "encoder_cache_misses",
    "num_preemptions": "num_preemptions",
}


def token_buckets(max_value: int) -> tuple[float, ...]:
    """1-2-5 ladder up to max_value (vLLM's scheme for token-count histograms)."""
    out: list[float] = []
    mantissas = (1, 2, 5)
    exponent = 0
    while True:
        for m in mantissas:
            v = m * 10**exponent
            if v > max_value:
                return tuple(out)
            out.append(float(v))
        exponent += 1


class EngineMetrics:
    """All server metrics of one model, in a private registry; `render()` serves `/metrics`.

    Thread-safe: prometheus_client's metric objects are, and the only state of our own (the last cumulative
    values seen by `update_engine_stats`) is guarded by a lock.
    """

    def __init__(self, model_name: str, tiers: Iterable[str] = (), max_model_len: int = 32768) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._last_cumulative: dict[str, float] = {}
        reg = self.registry
        m = ["model_name"]
        mt = ["model_name", "tier"]

        def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, mt, buckets=buckets, registry=reg)

        self.num_requests_running = Gauge(PREFIX + "num_requests_running",
                                          "Requests in the running batch.", m, registry=reg)
        self.num_requests_waiting = Gauge(PREFIX + "num_requests_waiting",
                                          "Requests waiting to be scheduled.", m, registry=reg)
        self.kv_cache_usage_perc = Gauge(PREFIX + "kv_cache_usage_perc",
                                         "KV-cache usage; 1 means 100 percent.", m, registry=reg)
        self.image_jobs_running = Gauge(PREFIX + "image_jobs_running",
                                        "Images being read, decoded and resized by the image pool.", m,
                                        registry=reg)
        self.image_jobs_waiting = Gauge(PREFIX + "image_jobs_waiting",
                                        "Image jobs queued for the image pool's workers.", m, registry=reg)
        self.token_budget = Gauge(PREFIX + "scheduler_token_budget",
                                  "Current token budget per step (at most max_num_batched_tokens).", m,
                                  registry=reg)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens of finished requests.", mt,
                                     registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests.",
                                         mt, registry=reg)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       [*mt, "finished_reason"], registry=reg)
        self.request_rejected = Counter(PREFIX + "request_rejected",
                                        "Requests refused before reaching the engine (queue_full, invalid, ...).",
                                        [*mt, "reason"], registry=reg)
        self.cumulative: dict[str, Counter] = {
            key: Counter(PREFIX + name, f"Cumulative {key.replace('_', ' ')} reported by the engine.", m,
                         registry=reg)
            for key, name in _CUMULATIVE.items()
        }

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (arrival -> first token).")
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive output tokens.", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token of a request after the first: the SLA TPOT.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency (arrival -> finish).")
        self.stage = {stage: hist(name, f"Time a request spent in the {stage} stage.")
                      for stage, name in _STAGE_METRICS.items()}
        tok = token_buckets(max_model_len)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", tok)
        self.request_generation_tokens = hist("request_generation_tokens", "Generated tokens per request.", tok)

        # Touch the engine-wide children so a scrape before the first stats update shows zeros, not nothing.
        for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc,
                       self.token_budget, self.image_jobs_running, self.image_jobs_waiting,
                       *self.cumulative.values()):
            metric.labels(model_name)
        for tier in tiers:
            self._touch_tier(tier)

    def _touch_tier(self, tier: str) -> None:
        labels = (self.model_name, tier)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.tpot, self.e2e,
                       self.request_prompt_tokens, self.request_generation_tokens, *self.stage.values()):
            metric.labels(*labels)

    def observe_finished(self, output: RequestOutput, tier: str = "default", itl: list[float] | None = None) -> None:
        """Record one finished request. `itl`: the measured gaps between its streamed tokens, when the caller has
        them; otherwise the request's mean gap is observed once (which narrows the histogram's tails)."""
        labels = (self.model_name, tier)
        n_prompt = len(output.prompt_token_ids)
        n_gen = output.num_output_tokens  # over all n completions; the prompt counts once
        longest = max(len(o.token_ids) for o in output.outputs)
        self.prompt_tokens.labels(*labels).inc(n_prompt)
        self.generation_tokens.labels(*labels).inc(n_gen)
        self.request_success.labels(*labels, output.finish_reason or "unknown").inc()
        self.request_prompt_tokens.labels(*labels).observe(n_prompt)
        self.request_generation_tokens.labels(*labels).observe(n_gen)

        ttft = output.ttft
        if ttft is not None:
            self.ttft.labels(*labels).observe(max(0.0, ttft))
        if output.finish_time is not None:
            self.e2e.labels(*labels).observe(max(0.0, output.finish_time - output.arrival_time))
        mean_gap: float | None = None
        if output.first_token_time is not None and output.finish_time is not None and longest >= 2:
            mean_gap = max(0.0, (output.finish_time - output.first_token_time) / (longest - 1))
            self.tpot.labels(*labels).observe(mean_gap)
        itl_child = self.itl.labels(*labels)
        if itl:
            for gap in itl:
                itl_child.observe(max(0.0, gap))
        elif mean_gap is not None:
            itl_child.observe(mean_gap)

        for stage, seconds in output.stages.items():
            hist = self.stage.get(stage)
            # A request without images (or whose images all hit the encoder cache) spends no time in the vision
            # tower; counting those zeros would bury the encode times the histogram exists to show.
            if hist is None or (stage == "vision" and seconds <= 0.0):
                continue
            hist.labels(*labels).observe(max(0.0, seconds))

    def observe_aborted(self, latest: RequestOutput | None, tier: str = "default") -> None:
        """Record a request aborted because its client went away: request_success{finished_reason="abort"}, and
        the tokens of `latest` (its newest output, if any arrived) as work done. The latency histograms are left
        alone: times cut short by the client say nothing about the service."""
        labels = (self.model_name, tier)
        self.request_success.labels(*labels, "abort").inc()
        if latest is not None:
            self.prompt_tokens.labels(*labels).inc(len(latest.prompt_token_ids))
            self.generation_tokens.labels(*labels).inc(latest.num_output_tokens)

    def update_engine_stats(self, stats: Mapping[str, Any]) -> None:
        """Refresh engine-wide metrics. Gauges: num_running, num_waiting, kv_cache_usage (0..1), token_budget,
        image_jobs_running, image_jobs_waiting.
        Cumulative counts (prefix_cache_queries/hits, encoder_cache_hits/misses, num_preemptions) become counter
        increments against the last values seen, so calling this twice with the same stats changes nothing.
        Missing or None keys are left alone."""
        gauges = {"num_running": self.num_requests_running, "num_waiting": self.num_requests_waiting,
                  "kv_cache_usage": self.kv_cache_usage_perc, "token_budget": self.token_budget,
                  "image_jobs_running": self.image_jobs_running, "image_jobs_waiting": self.image_jobs_waiting}
        for key, gauge in gauges.items():
            value = stats.get(key)
            if value is not None:
                gauge.labels(self.model_name).set(float(value))
        with self._lock:
            for key, counter in self.cumulative.items():
                value = stats.get(key)
                if value is None:
                    continue
                value = float(value)
                last = self._last_cumulative.get(key, 0.0)
                # A value below the last one means the engine's counter restarted from zero (a new engine
                # behind the same server): everything since the restart is new, as in Prometheus' rate().
                delta = value - last if value >= last else value
                if delta > 0:
                    counter.labels(self.model_name).inc(delta)
                self._last_cumulative[key] = value

    def reject(self, reason: str, tier: str = "default") -> None:
        """Count a request refused before it reached the engine (reason: queue_full, invalid, ...)."""
        self.request_rejected.labels(self.model_name, tier, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """Body and Content-Type for the `/metrics` route."""
        return generate_latest(self.registry), CONTENT_TYPE
