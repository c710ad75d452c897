"""EngineMetrics: exposition parses, counters and histograms move, tier labels, idempotent cumulative stats."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flashvlm.request import CompletionOutput, RequestOutput
from flashvlm.server.metrics import EngineMetrics, token_buckets


def _output(rid: str = "r1", n_prompt: int = 10, n_gen: int = 5, finish_reason: str | None = "stop",
            stages: dict[str, float] | None = None) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt_token_ids=list(range(n_prompt)),
                         outputs=[CompletionOutput(0, list(range(n_gen)), "x", finish_reason)],
                         arrival_time=1000.0, first_token_time=1000.25,
                         finish_time=1001.25, num_cached_tokens=4,
                         stages=stages if stages is not None else {"preprocess": 0.01, "queue": 0.04, "vision": 0.1,
                                                                   "prefill": 0.1, "decode": 0.95,
                                                                   "detokenize": 0.05})


def _samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the rendered exposition, keyed by (sample name, sorted labels)."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": metrics.model_name, **labels}.items())))
    return _samples(metrics).get(key, 0.0)


def test_exposition_parses_and_names_all_metrics() -> None:
    m = EngineMetrics("tiny", tiers=["gold"])
    m.observe_finished(_output(), tier="gold")
    m.reject("queue_full", tier="bronze")
    families = {f.name for f in text_string_to_metric_families(m.render()[0].decode())}
    expected = {
        "flashvlm:num_requests_running", "flashvlm:num_requests_waiting", "flashvlm:kv_cache_usage_perc",
        "flashvlm:prompt_tokens", "flashvlm:generation_tokens", "flashvlm:request_success",
        "flashvlm:prefix_cache_queries", "flashvlm:prefix_cache_hits", "flashvlm:encoder_cache_hits",
        "flashvlm:encoder_cache_misses", "flashvlm:request_rejected",
        "flashvlm:time_to_first_token_seconds", "flashvlm:inter_token_latency_seconds",
        "flashvlm:e2e_request_latency_seconds", "flashvlm:request_queue_time_seconds",
        "flashvlm:request_prefill_time_seconds", "flashvlm:request_decode_time_seconds",
        "flashvlm:request_vision_encode_time_seconds", "flashvlm:request_preprocess_time_seconds",
        "flashvlm:request_prompt_tokens", "flashvlm:request_generation_tokens",
    }
    assert expected <= families, expected - families
    samples = _samples(m)
    # Counters are exposed with the conventional _total suffix.
    assert ("flashvlm:prompt_tokens_total", (("model_name", "tiny"), ("tier", "gold"))) in samples


def test_observe_finished_moves_counters_and_histograms_per_tier() -> None:
    m = EngineMetrics("tiny")
    m.observe_finished(_output("a", n_prompt=10, n_gen=5), tier="gold")
    m.observe_finished(_output("b", n_prompt=7, n_gen=3, finish_reason="length"), tier="gold")
    m.observe_finished(_output("c", n_prompt=1, n_gen=1), tier="bronze")
    assert _value(m, "flashvlm:prompt_tokens_total", tier="gold") == 17
    assert _value(m, "flashvlm:generation_tokens_total", tier="gold") == 8
    assert _value(m, "flashvlm:prompt_tokens_total", tier="bronze") == 1
    assert _value(m, "flashvlm:request_success_total", tier="gold", finished_reason="stop") == 1
    assert _value(m, "flashvlm:request_success_total", tier="gold", finished_reason="length") == 1
    assert _value(m, "flashvlm:time_to_first_token_seconds_count", tier="gold") == 2
    assert _value(m, "flashvlm:time_to_first_token_seconds_sum", tier="gold") == pytest.approx(0.5)
    # TTFT 0.25 s: not in the 0.1 bucket, in the 0.25 bucket.
    assert _value(m, "flashvlm:time_to_first_token_seconds_bucket", tier="gold", le="0.1") == 0
    assert _value(m, "flashvlm:time_to_first_token_seconds_bucket", tier="gold", le="0.25") == 2
    assert _value(m, "flashvlm:e2e_request_latency_seconds_sum", tier="bronze") == pytest.approx(1.25)
    assert _value(m, "flashvlm:request_decode_time_seconds_sum", tier="gold") == pytest.approx(1.9)
    assert _value(m, "flashvlm:request_queue_time_seconds_count", tier="bronze") == 1
    assert _value(m, "flashvlm:request_prompt_tokens_sum", tier="gold") == 17
    # Mean gap of "a": 1 s over 4 gaps; "c" has a single token, so no gap at all.
    assert _value(m, "flashvlm:inter_token_latency_seconds_count", tier="gold") == 2
    assert _value(m, "flashvlm:inter_token_latency_seconds_count", tier="bronze") == 0


def test_itl_gaps_observed_individually_and_zero_vision_skipped() -> None:
    m = EngineMetrics("tiny")
    stages = {"queue": 0.0, "vision": 0.0, "prefill": 0.2, "decode": 1.0}
    m.observe_finished(_output(stages=stages), tier="silver", itl=[0.01, 0.02, 0.03, 0.04])
    assert _value(m, "flashvlm:inter_token_latency_seconds_count", tier="silver") == 4
    assert _value(m, "flashvlm:inter_token_latency_seconds_sum", tier="silver") == pytest.approx(0.1)
    assert _value(m, "flashvlm:request_vision_encode_time_seconds_count", tier="silver") == 0
    assert _value(m, "flashvlm:request_queue_time_seconds_count", tier="silver") == 1


def test_engine_stats_gauges_and_idempotent_cumulative_counters() -> None:
    m = EngineMetrics("tiny")
    # Engine-wide series exist before the first update.
    assert ("flashvlm:num_requests_running", (("model_name", "tiny"),)) in _samples(m)
    stats = {"num_running": 3, "num_waiting": 7, "kv_cache_usage": 0.42, "prefix_cache_queries": 100,
             "prefix_cache_hits": 40, "encoder_cache_hits": 2, "encoder_cache_misses": 5}
    m.update_engine_stats(stats)
    m.update_engine_stats(stats)  # the same cumulative values again: no increment
    assert _value(m, "flashvlm:num_requests_running") == 3
    assert _value(m, "flashvlm:num_requests_waiting") == 7
    assert _value(m, "flashvlm:kv_cache_usage_perc") == pytest.approx(0.42)
    assert _value(m, "flashvlm:prefix_cache_queries_total") == 100
    assert _value(m, "flashvlm:prefix_cache_hits_total") == 40
    assert _value(m, "flashvlm:encoder_cache_misses_total") == 5

    m.update_engine_stats({"prefix_cache_queries": 150, "num_running": 1})  # partial: others untouched
    assert _value(m, "flashvlm:prefix_cache_queries_total") == 150
    assert _value(m, "flashvlm:prefix_cache_hits_total") == 40
    assert _value(m, "flashvlm:num_requests_running") == 1
    assert _value(m, "flashvlm:num_requests_waiting") == 7

    # A counter that went backwards means the engine restarted: count what it reports since then.
    m.update_engine_stats({"prefix_cache_queries": 30})
    assert _value(m, "flashvlm:prefix_cache_queries_total") == 180


def test_reject_counts_by_reason_and_tier() -> None:
    m = EngineMetrics("tiny")
    m.reject("queue_full", tier="bronze")
    m.reject("queue_full", tier="bronze")
    m.reject("invalid")
    assert _value(m, "flashvlm:request_rejected_total", tier="bronze", reason="queue_full") == 2
    assert _value(m, "flashvlm:request_rejected_total", tier="default", reason="invalid") == 1


def test_aborted_requests_count_as_success_with_reason_abort() -> None:
    m = EngineMetrics("tiny")
    m.observe_aborted(_output(n_prompt=7, n_gen=3, finish_reason=None), tier="gold")
    m.observe_aborted(None)  # left before the engine produced anything
    assert _value(m, "flashvlm:request_success_total", tier="gold", finished_reason="abort") == 1
    assert _value(m, "flashvlm:request_success_total", tier="default", finished_reason="abort") == 1
    assert _value(m, "flashvlm:prompt_tokens_total", tier="gold") == 7
    assert _value(m, "flashvlm:generation_tokens_total", tier="gold") == 3
    assert _value(m, "flashvlm:e2e_request_latency_seconds_count", tier="gold") == 0  # cut-short times are left out


def test_instances_do_not_share_state() -> None:
    a, b = EngineMetrics("same"), EngineMetrics("same")  # same names: a global registry would raise here
    a.observe_finished(_output(), tier="gold")
    assert _value(a, "flashvlm:prompt_tokens_total", tier="gold") == 10
    assert _value(b, "flashvlm:prompt_tokens_total", tier="gold") == 0


def test_token_buckets() -> None:
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(32768)[-1] == 20000
