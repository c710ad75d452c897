"""Slow and stalled clients cannot hold the server: a request head must arrive within --header-read-timeout, a
body that stops sending is answered 408 after --body-read-timeout and its bytes let go, and the bytes of bodies
in flight across all requests stay under --max-body-bytes-in-flight (503 past it). Raw sockets play the clients;
every wait is bounded and nothing asserts how long anything took. Each refusal leaves its one rejection line."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import (
    LIMIT_IMAGES,
    MAX_IMAGE_BYTES,
    MODEL,
    LiveServer,
    make_llm,
    rejection_lines,
    start_server,
)

MIB = 1 << 20
BODY_LIMIT = LIMIT_IMAGES * MAX_IMAGE_BYTES * 4 // 3 + 16 * MIB  # the per-request limit build_app derives
IN_FLIGHT = BODY_LIMIT + MIB
CHAT = "/v1/chat/completions"
HEAD = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def guarded(tiny_ckpt: Path, media_dir: Path) -> Iterator[LiveServer]:
    server = start_server(make_llm(tiny_ckpt), media_dir, with_metrics=False, header_read_timeout_s=1.0,
                          body_read_timeout_s=1.0, max_body_bytes_in_flight=IN_FLIGHT)
    yield server
    server.stop()


def _connect(live: LiveServer) -> socket.socket:
    host, port = live.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)  # a server that never closes fails the recv


def _read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    reply = b""
    while chunk := sock.recv(65536):
        reply += chunk
    return reply


def _held(live: LiveServer) -> int:
    return live.app.state.body_budget.held_bytes


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _chat_ok(live: LiveServer, **extra: str) -> bool:
    r = httpx.post(live.v1 + "/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra})
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_half_sent_head_is_disconnected(guarded: LiveServer) -> None:
    with _connect(guarded) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        assert _read_all(sock) == b""
    with _connect(guarded) as sock:  # a client that opens and never sends a byte
        assert _read_all(sock) == b""
    with _connect(guarded) as sock:  # trickling bytes does not move the deadline
        for c in b"POST /v1/chat/completions HTTP/1.1\r\n":
            try:
                sock.sendall(bytes([c]))
            except OSError:
                break  # already closed
            time.sleep(0.1)
        assert _read_all(sock) == b""
    assert _chat_ok(guarded)


def test_stalled_chunked_upload_is_dropped_while_others_are_served(guarded: LiveServer,
                                                                   rejections: pytest.LogCaptureFixture) -> None:
    with _connect(guarded) as sock:
        sock.sendall(f"{HEAD}x-request-id: stall-1\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        sock.sendall(f"{MIB:x}\r\n".encode() + b" " * MIB + b"\r\n")
        _wait_for(lambda: _held(guarded) >= MIB, "the first chunk never counted")
        assert _chat_ok(guarded)  # served while the upload hangs
        reply = _read_all(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:300]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    _wait_for(lambda: _held(guarded) == 0, "the stalled body's bytes were not let go")
    [(level, line)] = rejection_lines(rejections, "stall-1")
    assert (level, line["status"], line["code"], line["path"]) == (logging.INFO, "408", "request_timeout", CHAT)
    assert "stalled" in line["reason"]


def test_concurrent_large_bodies_past_the_global_bound_get_503(guarded: LiveServer,
                                                               rejections: pytest.LogCaptureFixture) -> None:
    big = 10 * MIB  # one fits under IN_FLIGHT, two do not
    first = _connect(guarded)
    try:
        first.sendall(f"{HEAD}Content-Length: {big}\r\n\r\n{{\"model\": ".encode())
        _wait_for(lambda: _held(guarded) >= big, "the declared body was not counted")
        with _connect(guarded) as second:
            second.sendall(f"{HEAD}x-request-id: busy-1\r\nContent-Length: {big}\r\n\r\n".encode())
            reply = _read_all(second)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower(), reply[:300]
        assert json.loads(body)["error"]["code"] == "server_busy"
        [(level, line)] = rejection_lines(rejections, "busy-1")  # a 503 of the server's state: WARNING
        assert (level, line["status"], line["code"]) == (logging.WARNING, "503", "server_busy")
        assert "in flight" in line["reason"]
        assert _chat_ok(guarded)  # a small body still fits
    finally:
        first.close()
    _wait_for(lambda: _held(guarded) == 0, "the abandoned body's bytes were not let go")
    assert _chat_ok(guarded, pad="x" * big)  # the freed budget takes a large body again


def test_chunked_body_is_counted_as_it_grows_and_refused_at_the_bound() -> None:
    from flashvlm.server.body import BodyBudget, BodyReader, BodyRefused

    budget = BodyBudget(3 * MIB)
    sent: list[int] = []

    async def receive() -> dict[str, object]:
        sent.append(MIB)
        return {"type": "http.request", "body": b"x" * MIB, "more_body": True}

    async def run() -> BodyRefused:
        budget.take(MIB)  # another request holds a third of the budget
        reader = BodyReader(budget, max_bytes=BODY_LIMIT, timeout_s=5)
        with pytest.raises(BodyRefused) as e:
            await reader.read(receive, None)  # never ends: only the budget stops it
        assert budget.held_bytes == 3 * MIB  # counted up to the bound, not past it
        reader.release()
        return e.value

    refused = asyncio.run(run())
    assert (refused.status, refused.code) == (503, "server_busy") and len(sent) == 3
    assert budget.held_bytes == MIB
    budget.give_back(MIB)
    assert budget.held_bytes == 0


def test_bad_bounds_are_refused(tiny_ckpt: Path, media_dir: Path) -> None:
    from flashvlm.server.http_server import build_server

    llm = make_llm(tiny_ckpt)
    with pytest.raises(ValueError, match="--max-body-bytes-in-flight"):
        start_server(llm, media_dir, max_body_bytes_in_flight=BODY_LIMIT - 1)
    with pytest.raises(ValueError, match="--body-read-timeout"):
        start_server(llm, media_dir, body_read_timeout_s=0)
    with pytest.raises(ValueError, match="--header-read-timeout"):
        build_server(None, header_read_timeout_s=0)
    with pytest.raises(ValueError, match="--shutdown-timeout"):
        build_server(None, shutdown_timeout_s=-1)
