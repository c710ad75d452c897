"""The OpenAI-compatible API over a real uvicorn server, through the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flashvlm.server.app import build_app
from flashvlm.server.serving import ServerSettings
from tests.server.conftest import MODEL, LiveServer, data_uri, image_message, make_llm, png_bytes, start_server

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)


def _sse_events(resp: httpx.Response) -> list[Any]:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_models_and_health(live: LiveServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(live.base_url + "/health").status_code == 200
    spec = httpx.get(live.base_url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(spec["paths"])


def test_chat_with_image_streaming_and_not(live: LiveServer, client: openai.OpenAI) -> None:
    messages = image_message("What is in the picture?", data_uri(png_bytes(seed=1)))
    expected_prompt = len(live.engine.engine.process_chat(json.loads(json.dumps(messages))).prompt_token_ids)
    extra = {"ignore_eos": True}
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, extra_body=extra, **GREEDY)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == expected_prompt  # the expanded prompt: image placeholders included
    assert full.usage.completion_tokens == 7
    assert full.usage.total_tokens == expected_prompt + 7

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=extra,
                                                 **GREEDY))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == expected_prompt
    # The same prompt again: its full blocks come from the prefix cache, and usage says so.
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_sse_wire_format(live: LiveServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            "ignore_eos": True, **GREEDY}
    with httpx.stream("POST", live.v1 + "/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert "usage" not in events[0]  # only with stream_options.include_usage


def test_completions(live: LiveServer, client: openai.OpenAI) -> None:
    extra = {"ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, extra_body=extra,
                                    **GREEDY)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    ids = live.engine.engine.process_prompt({"prompt": "The quick brown fox"}).prompt_token_ids
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 5
    streamed = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, stream=True,
                                              extra_body=extra, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, extra_body=extra, **GREEDY)
    assert by_ids.choices[0].text == out.choices[0].text


def test_stop_string_never_streams_past_the_stop(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Count"}], max_tokens=24,
                              extra_body={"ignore_eos": True}, **GREEDY)
    free = client.chat.completions.create(**kw).choices[0].message.content
    assert len(free) >= 6
    stop = free[3:6]
    full = client.chat.completions.create(stop=[stop], **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stop=[stop], stream=True, **kw) if c.choices)
    assert full.choices[0].finish_reason == "stop"
    assert streamed == full.choices[0].message.content == free[:free.index(stop)]


def test_local_file_image_matches_data_uri(live: LiveServer, client: openai.OpenAI) -> None:
    path = live.media_dir / "pic.png"
    answers = []
    for url in (str(path), path.as_uri(), "pic.png", data_uri(path.read_bytes())):
        out = client.chat.completions.create(model=MODEL, messages=image_message("Describe.", url), max_tokens=5,
                                             **GREEDY)
        answers.append((out.choices[0].message.content, out.usage.prompt_tokens))
    assert len(set(answers)) == 1


def test_request_id_echo_and_body_request_id(live: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(live.v1 + "/chat/completions", json=body, headers={"x-request-id": "abc-123"}, timeout=30)
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"] == "chatcmpl-abc-123" and r.json()["model"] == MODEL  # model is optional
    r = httpx.post(live.v1 + "/chat/completions", json={**body, "request_id": "mine-1"}, timeout=30)
    assert r.json()["id"] == "chatcmpl-mine-1" and r.headers["x-request-id"] == "mine-1"
    r = httpx.post(live.v1 + "/chat/completions", json={**body, "n": 0}, headers={"x-request-id": "bad-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"


def _samples(live: LiveServer) -> dict[tuple[str, frozenset], float]:
    r = httpx.get(live.base_url + "/metrics")
    assert r.status_code == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def test_metrics_move_with_tiers(live: LiveServer, client: openai.OpenAI) -> None:
    def gen_tokens(tier: str) -> float:
        return _samples(live).get(("flashvlm:generation_tokens_total",
                                   frozenset({"model_name": MODEL, "tier": tier}.items())), 0.0)

    before_gold, before_silver = gen_tokens("gold"), gen_tokens("silver")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                   extra_body={"ignore_eos": True}, extra_headers={"x-sla-tier": "gold"})
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                   extra_body={"ignore_eos": True, "sla_tier": "silver"})
    assert gen_tokens("gold") == before_gold + 4
    assert gen_tokens("silver") == before_silver + 3
    samples = _samples(live)
    names = {name for name, _ in samples}
    for needed in ("flashvlm:num_requests_running", "flashvlm:kv_cache_usage_perc", "flashvlm:prefix_cache_hits_total",
                   "flashvlm:time_to_first_token_seconds_count", "flashvlm:e2e_request_latency_seconds_count",
                   "flashvlm:inter_token_latency_seconds_count", "flashvlm:request_queue_time_seconds_count"):
        assert needed in names, needed
    assert samples[("flashvlm:prefix_cache_queries_total", frozenset({"model_name": MODEL}.items()))] > 0


def test_trace_span_per_request_continues_traceparent(live: LiveServer, span_exporter: Any) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    span_exporter.clear()
    r = httpx.post(live.v1 + "/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 2},
                   headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"}, timeout=30)
    assert r.status_code == 200
    roots = [s for s in span_exporter.get_finished_spans() if s.attributes.get("flashvlm.request_id")]
    assert len(roots) == 1 and format(roots[0].context.trace_id, "032x") == trace_id
    assert roots[0].attributes["gen_ai.usage.output_tokens"] == 2


def test_client_disconnect_mid_stream_frees_blocks(live: LiveServer) -> None:
    aborted = live.engine.stats()["num_aborted"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.v1 + "/chat/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data: ")
            if seen >= 3:
                break  # leave mid-stream: closing the response drops the connection
    stats = live.wait_idle()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_aborted"] == aborted + 1


def test_engine_fault_fails_only_its_request(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = live.engine.engine.runner
    real = runner.execute

    def faulty(out: Any) -> Any:
        if any(s.request.request_id.startswith("boom") for s in out.scheduled):
            raise RuntimeError("injected fault")
        return real(out)

    monkeypatch.setattr(runner, "execute", faulty)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(live.v1 + "/chat/completions", json={**body, "request_id": "boom-1"}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert "injected fault" in r.json()["error"]["message"]
    with httpx.stream("POST", live.v1 + "/chat/completions", json={**body, "request_id": "boom-2", "stream": True},
                      timeout=30) as resp:
        events = _sse_events(resp)
    assert any(isinstance(e, dict) and "error" in e for e in events) and events[-1] == "[DONE]"
    ok = httpx.post(live.v1 + "/chat/completions", json=body, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    stats = live.wait_idle()
    assert stats["num_step_failures"] >= 2 and stats["num_free_blocks"] == stats["num_usable_blocks"]
    assert httpx.get(live.base_url + "/health").status_code == 200


@pytest.fixture
def wide(tiny_ckpt: Path, media_dir: Path) -> Iterator[LiveServer]:
    """A server whose requests may run for thousands of tokens."""
    server = start_server(make_llm(tiny_ckpt, max_model_len=4096), media_dir)
    yield server
    server.stop()


def test_a_fault_after_the_scheduler_finished_a_request_still_answers_it(wide: LiveServer,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that fails after the scheduler's update has finished a request (it left the running batch, its output
    not made yet) fails that request too, beside the running ones, instead of leaving its client waiting."""
    live = wide
    scheduler = live.engine.engine.scheduler
    real = scheduler.update

    def update_then_fail(out: Any, sampled: Any) -> Any:
        changed = real(out, sampled)
        if any(r.request_id.startswith("lateboom") and r.is_finished for r in changed):
            raise RuntimeError("injected fault after update")
        return changed

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.stream("POST", live.v1 + "/chat/completions", timeout=60,
                      json={**body, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as long_stream:
        lines = long_stream.iter_lines()
        while '"content":""' in next(lines) or not scheduler.running_request_ids():
            pass  # until the long request decodes: it is in the running batch when the fault comes
        monkeypatch.setattr(scheduler, "update", update_then_fail)
        r = httpx.post(live.v1 + "/chat/completions", json={**body, "max_tokens": 1, "request_id": "lateboom"},
                       timeout=30)
        monkeypatch.setattr(scheduler, "update", real)
    assert r.status_code == 500 and "injected fault after update" in r.json()["error"]["message"]
    stats = wide.wait_idle()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


def test_api_key_and_no_tiers(live: LiveServer) -> None:
    """A second app over the same engine (in-process ASGI): --api-key enforced; --sla-config none uses `priority`."""
    app = build_app(live.engine, ServerSettings(served_model_names=[MODEL], api_key="sesame", tiers=None,
                                                disable_log_requests=True))
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            return [await client.post("/v1/chat/completions", json=body),
                    await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}),
                    await client.post("/v1/chat/completions", json={**body, "priority": -3},
                                      headers={"Authorization": "Bearer sesame"}),
                    await client.post("/v1/chat/completions", json={**body, "sla_tier": "gold"},
                                      headers={"Authorization": "Bearer sesame"}),
                    await client.get("/health")]

    no_key, wrong_key, ok, tier, health = asyncio.run(run())
    assert no_key.status_code == wrong_key.status_code == 401
    assert no_key.json()["error"]["type"] == "authentication_error"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert tier.status_code == 400 and "not configured" in tier.json()["error"]["message"]
    assert health.status_code == 200  # only /v1/* needs the key


@pytest.mark.slow
def test_serve_cli_end_to_end(tiny_ckpt: Any, tmp_path: Any) -> None:
    """`flashvlm serve` as a user runs it: a subprocess on a free port, one chat, then SIGTERM."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "flashvlm.cli", "serve", "--model", str(tiny_ckpt), "--port", str(port),
           "--device", "cpu", "--max-model-len", "256", "--kv-cache-tokens", "2048", "--served-model-name", "cli-model",
           "--limit-mm-per-prompt", '{"image": 1}', "--disable-log-requests"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "flashvlm serve did not come up"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="cli-model", messages=image_message("Hi", data_uri(png_bytes())),
                                             max_tokens=3, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        two = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={
            "model": "cli-model", "max_tokens": 2,
            "messages": image_message("Hi", data_uri(png_bytes()), data_uri(png_bytes(seed=9)))})
        assert two.status_code == 400 and two.json()["error"]["code"] == "too_many_images"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) is not None
