"""Every refused request leaves one log line: `request <id> rejected: <status> <code> (<METHOD> <path>): <reason>`,
whichever layer refused it (validation, the engine's checks, the body limit, routing, the API key)."""

from __future__ import annotations

import logging
import socket
from typing import Any

import httpx
import pytest

from flashvlm.server.app import log_rejection
from tests.server.conftest import LIMIT_IMAGES, MAX_IMAGE_BYTES, MAX_MODEL_LEN, MODEL, LiveServer, rejection_lines

CHAT = "/v1/chat/completions"

# (request id, path, JSON body or raw bytes, status, code, words of the reason)
CASES: list[tuple[str, str, Any, int, str, str]] = [
    ("rej-json", CHAT, b'{"messages": [', 400, "invalid_json", "not valid JSON"),
    ("rej-field", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400,
     "invalid_request", "temperature"),
    ("rej-engine", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "fox " * MAX_MODEL_LEN}]}, 400,
     "context_length_exceeded", "max_model_len"),
    ("rej-unsupported", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                         "presence_penalty": 1}, 400, "-", "presence_penalty"),
    ("rej-model", CHAT, {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]}, 404, "model_not_found",
     "gpt-5"),
    ("rej-route", "/v1/embeddings", {"input": "x"}, 404, "-", "Not Found"),
    ("rej-newline", CHAT, {"model": "a\nb", "messages": [{"role": "user", "content": "x"}]}, 404,
     "model_not_found", "a\\nb"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_line_per_rejected_request(live: LiveServer, rejections: pytest.LogCaptureFixture,
                                       case: tuple[str, str, Any, int, str, str]) -> None:
    request_id, path, body, status, code, words = case
    headers = {"x-request-id": request_id, "content-type": "application/json"}
    raw = body if isinstance(body, bytes) else None
    r = httpx.post(live.base_url + path, content=raw, json=None if raw else body, headers=headers, timeout=30)
    assert r.status_code == status, r.text[:300]
    lines = rejection_lines(rejections, request_id)  # logged before the answer is sent
    assert len(lines) == 1, [rec.getMessage() for rec in rejections.records]
    level, line = lines[0]
    assert level == logging.INFO
    assert (line["status"], line["method"], line["path"]) == (str(status), "POST", path)
    if code != "-":
        assert line["code"] == code, line
    assert words in line["reason"] and r.json()["error"]["message"].startswith(line["reason"][:40]), line


def test_oversized_body_is_logged(live: LiveServer, rejections: pytest.LogCaptureFixture) -> None:
    limit = LIMIT_IMAGES * MAX_IMAGE_BYTES * 4 // 3 + 16 * 1024 * 1024
    host, port = live.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nx-request-id: rej-big\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {limit + 1}\r\n\r\n".encode())
        reply = b""
        while b"}}" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413")
    [(_, line)] = rejection_lines(rejections, "rej-big")
    assert line["status"] == "413" and line["code"] == "request_too_large"


def test_accepted_requests_log_no_rejection(live: LiveServer, rejections: pytest.LogCaptureFixture) -> None:
    r = httpx.post(live.v1 + "/chat/completions", headers={"x-request-id": "ok-1"}, timeout=30,
                   json={"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    assert rejection_lines(rejections, "ok-1") == []


def test_server_faults_log_at_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="flashvlm.server")
    scope = {"state": {"request_id": "abc"}, "method": "POST", "path": CHAT}
    log_rejection(scope, 503, "engine_dead", "the engine is not running")
    log_rejection({"method": "GET", "path": "/x"}, 401, None, "two\nlines")
    messages = [(rec.levelno, rec.getMessage()) for rec in caplog.records if rec.name == "flashvlm.server"]
    assert messages == [
        (logging.WARNING, f"request abc rejected: 503 engine_dead (POST {CHAT}): the engine is not running"),
        (logging.INFO, "request - rejected: 401 - (GET /x): two\\nlines")]

