"""Request handling edge cases over a real server: streamed-body limits, shared client request ids, explicit JSON
nulls, the default max_tokens under a small KV cache, and aborted requests in the metrics."""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from flashvlm.server.protocol import ChatCompletionRequest
from tests.server.conftest import (
    LIMIT_IMAGES,
    MAX_IMAGE_BYTES,
    MAX_MODEL_LEN,
    MODEL,
    LiveServer,
    make_llm,
    start_server,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BODY_LIMIT = LIMIT_IMAGES * MAX_IMAGE_BYTES * 4 // 3 + 16 * 1024 * 1024


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


# ---- body size without Content-Length ----------------------------------------------------------
def _send_chunked_until_answered(base_url: str, total_bytes: int) -> bytes:
    """POST a chunked body of `total_bytes` over a raw socket, stopping early once the server answers."""
    host, port = base_url.removeprefix("http://").split(":")
    chunk = b"a" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        sent = 0
        try:
            while sent < total_bytes and not select.select([sock], [], [], 0)[0]:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                sent += len(chunk)
            if sent >= total_bytes:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed while we were still sending
        reply = b""
        while b"}}" not in reply:
            try:
                data = sock.recv(65536)
            except OSError:
                break
            if not data:
                break
            reply += data
    return reply


def test_chunked_body_over_the_limit_is_413(live: LiveServer) -> None:
    reply = _send_chunked_until_answered(live.base_url, BODY_LIMIT + 4 * (1 << 20))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply[:300]
    assert b"request_too_large" in body and b"limit" in body


def test_chunked_body_under_the_limit_is_served(live: LiveServer) -> None:
    def parts() -> Iterator[bytes]:
        yield b'{"model": "tiny-vlm", "max_tokens": 2, "messages": [{"role": "user", '
        yield b'"content": "Hi"}]}'

    r = httpx.post(live.v1 + "/chat/completions", content=parts(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


# ---- request ids -------------------------------------------------------------------------------
def test_concurrent_requests_may_share_a_client_request_id(live: LiveServer) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = _chat(max_tokens=20, ignore_eos=True)
            by_header = [client.post(live.v1 + "/chat/completions", json=body, headers={"x-request-id": "trace-1"})
                         for _ in range(3)]
            by_body = [client.post(live.v1 + "/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 20,
                                                                     "ignore_eos": True, "request_id": "mine-2"})
                       for _ in range(3)]
            return await asyncio.gather(*by_header, *by_body)

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 6, [r.text[:200] for r in responses]
    for r in responses[:3]:
        assert r.headers["x-request-id"] == "trace-1" and r.json()["id"] == "chatcmpl-trace-1"
    for r in responses[3:]:
        assert r.headers["x-request-id"] == "mine-2" and r.json()["id"] == "cmpl-mine-2"
    live.wait_idle()


# ---- explicit nulls ----------------------------------------------------------------------------
_NULLABLE_CHAT = ["model", "n", "stream", "stream_options", "logprobs", "top_logprobs", "presence_penalty",
                  "frequency_penalty", "min_tokens", "ignore_eos", "priority", "temperature", "top_p", "top_k",
                  "min_p", "repetition_penalty", "seed", "stop", "stop_token_ids", "skip_special_tokens", "user",
                  "logit_bias", "response_format", "tools", "tool_choice", "mm_processor_kwargs", "request_id",
                  "sla_tier", "max_completion_tokens"]
_NULLABLE_COMPLETION = ["n", "stream", "echo", "suffix", "best_of", "logprobs", "max_tokens", "min_tokens",
                        "ignore_eos", "priority", "presence_penalty", "frequency_penalty"]


@pytest.mark.parametrize("field", _NULLABLE_CHAT)
def test_chat_field_sent_as_null_means_its_default(live: LiveServer, field: str) -> None:
    r = httpx.post(live.v1 + "/chat/completions", json=_chat(**{field: None}), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("field", _NULLABLE_COMPLETION)
def test_completion_field_sent_as_null_means_its_default(live: LiveServer, field: str) -> None:
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 2, "ignore_eos": True, field: None}
    r = httpx.post(live.v1 + "/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    if field == "max_tokens":  # null is no limit (the rest of the context), as in OpenAI's API and vLLM, not 16
        assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    else:
        assert usage["completion_tokens"] == 2


def test_null_stream_options_fields_mean_their_defaults(live: LiveServer) -> None:
    body = _chat(stream=True, stream_options={"include_usage": None, "continuous_usage_stats": None})
    r = httpx.post(live.v1 + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert '"usage":{' not in r.text  # include_usage null is false


# ---- small things ------------------------------------------------------------------------------
def test_priority_description_matches_the_tier_rule() -> None:
    description = ChatCompletionRequest.model_fields["priority"].description or ""
    assert "overrides" in description and "ignored" not in description


def _success_count(live: LiveServer, reason: str, tier: str = "silver") -> float:
    text = httpx.get(live.base_url + "/metrics").text
    labels = {"model_name": MODEL, "tier": tier, "finished_reason": reason}
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "flashvlm:request_success_total" and s.labels == labels)


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_client_aborts_count_as_finished_with_reason_abort(live: LiveServer) -> None:
    before = _success_count(live, "abort")
    body = _chat(max_tokens=200, ignore_eos=True, stream=True)
    with httpx.stream("POST", live.v1 + "/chat/completions", json=body, timeout=30) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 4:
                break  # leave mid-stream
    assert _wait_for(lambda: _success_count(live, "abort") == before + 1), _success_count(live, "abort")

    # A non-streamed request whose client leaves while it runs.
    host, port = live.base_url.removeprefix("http://").split(":")
    payload = httpx.Request("POST", "http://x" + CHAT, json=_chat(max_tokens=200, ignore_eos=True)).content
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        assert _wait_for(lambda: live.engine.stats()["num_running"] >= 1)
    assert _wait_for(lambda: _success_count(live, "abort") == before + 2), _success_count(live, "abort")
    live.wait_idle()


# ---- default max_tokens under a KV cache smaller than max_model_len --------------------------------
@pytest.fixture(scope="module")
def small_kv_server(tiny_ckpt: Path, media_dir: Path) -> Iterator[LiveServer]:
    server = start_server(make_llm(tiny_ckpt, kv_cache_tokens=128), media_dir, with_metrics=False)
    yield server
    server.stop()


def _kv_capacity_tokens(server: LiveServer) -> int:
    return server.engine.stats()["kv_num_blocks"] * server.engine.engine.config.cache.block_size


def test_default_max_tokens_fits_the_kv_cache(small_kv_server: LiveServer) -> None:
    capacity = _kv_capacity_tokens(small_kv_server)
    assert capacity + 1 < MAX_MODEL_LEN  # the point of this server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}
    r = httpx.post(small_kv_server.v1 + "/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    # The last sampled token needs no KV, so the whole cache plus one token is the most a request can reach.
    assert usage["total_tokens"] == capacity + 1
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None  # max_tokens, not a KV abort


def test_kv_cache_limits_are_named_in_the_error(small_kv_server: LiveServer) -> None:
    capacity = _kv_capacity_tokens(small_kv_server)
    r = httpx.post(small_kv_server.v1 + "/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": capacity})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "KV cache" in r.json()["error"]["message"]
    long_prompt = [1] * (capacity + 10)  # fits max_model_len, not the KV cache
    r = httpx.post(small_kv_server.v1 + "/completions", timeout=30,
                   json={"model": MODEL, "prompt": long_prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "KV cache" in r.json()["error"]["message"]
    assert small_kv_server.wait_idle()["num_free_blocks"] == small_kv_server.wait_idle()["num_usable_blocks"]
