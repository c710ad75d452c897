"""The Grafana dashboard shipped in deploy/grafana/ queries only series our /metrics serves, with labels those
series carry, so a renamed or dropped metric fails here instead of leaving a blank panel."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, LiveServer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "flashvlm.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "flashvlm-scrape.yml"
_SELECTOR = re.compile(r"(flashvlm:[A-Za-z0-9_:]+)(\{[^}]*\})?")
_BY = re.compile(r"\bby \(([^)]*)\)")


def _queries(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def _served_series(live: LiveServer) -> dict[str, set[str]]:
    """Sample name -> its label names, from a scrape after the server saw a finished and a refused request (so
    the series that appear only once something happened are there too)."""
    ok = httpx.post(live.v1 + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert ok.status_code == 200
    bad = httpx.post(live.v1 + "/chat/completions", timeout=60, json={
        "model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]})
    assert bad.status_code == 404
    text = httpx.get(live.base_url + "/metrics", timeout=30).text
    series: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, set()).update(sample.labels)
    return series


def test_every_dashboard_query_reads_served_series(live: LiveServer) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    series = _served_series(live)
    queries = _queries(dashboard)
    assert len(queries) > 20
    seen: set[str] = set()
    for expr in queries:
        labels_here: set[str] = {"le"}
        for name, matchers in _SELECTOR.findall(expr):
            assert name in series, f"{name} (in {expr!r}) is not served by /metrics"
            seen.add(name)
            labels_here |= series[name]
            for label in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*=~?", matchers):
                assert label in series[name], f"{name} has no label {label!r} ({expr!r})"
        for group in _BY.findall(expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in labels_here, f"grouping by {label!r}, which {expr!r}'s series lack"
        for label in re.findall(r"label_values\([^,]+,\s*([A-Za-z_]+)\)", expr):
            assert label in labels_here, expr
    # The gauges, counters and latency histograms an operator needs are all on it.
    for needed in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "request_rejected_total",
                   "time_to_first_token_seconds_bucket", "request_time_per_output_token_seconds_bucket",
                   "prefix_cache_hits_total"):
        assert f"flashvlm:{needed}" in seen, needed


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "model", "tier"}


def test_scrape_config_points_at_metrics() -> None:
    [job] = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
