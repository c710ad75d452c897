"""A bounded fault suite against a real `flashvlm serve` on loopback: clients hanging up mid-stream leave no
running, waiting or KV state behind; a soak of random requests, bad ones mixed in, gets no 5xx, seeded requests
repeat exactly and resident memory stays bounded; stalled uploads do not hold up other clients. Every wait is
bounded and nothing asserts how long anything took."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import random
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.server.serve_process import MODEL, ServeProcess, serve, wait_for

pytestmark = pytest.mark.slow

MIB = 1 << 20
CHAT = "/v1/chat/completions"
SOAK_REQUESTS = 300
RSS_GROWTH_LIMIT = 128 * MIB
"""Resident memory the soak may add after its warm-up: the caches' fill and allocator slack, far below what
keeping every request's body, images or outputs would take."""


@pytest.fixture(scope="module")
def server(tiny_ckpt: Path) -> Iterator[ServeProcess]:
    proc = serve(tiny_ckpt, "--body-read-timeout", "2", "--limit-mm-per-prompt", "image=2", "--max-num-seqs", "16",
                 "--max-waiting-requests", "1024")
    yield proc
    out = proc.output()
    proc.stop()
    assert "Traceback" not in out, out[-4000:]


def _png(seed: int, size: int = 56) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _idle(server: ServeProcess, kv_baseline: float) -> None:
    def idle() -> bool:
        return (server.gauge("num_requests_running") == 0 and server.gauge("num_requests_waiting") == 0
                and server.gauge("kv_cache_usage_perc") <= kv_baseline)
    wait_for(idle, "requests or KV blocks were left behind", timeout_s=30)


def _kv_baseline(server: ServeProcess) -> float:
    r = httpx.post(server.base + CHAT, timeout=60, json={"model": MODEL, "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": "warm"}]})
    assert r.status_code == 200
    wait_for(lambda: server.gauge("num_requests_running") == 0, "the warm-up request did not finish")
    return server.gauge("kv_cache_usage_perc")


# ---- clients hanging up -----------------------------------------------------------------------------------
def _hang_up_stream(base: str, events: int, image: bool) -> int:
    """Read `events` SSE events of a long stream, then close the connection; the events read."""
    content: Any = "Tell me a long story"
    if image:
        content = [{"type": "image_url", "image_url": {"url": _uri(_png(events))}}, {"type": "text", "text": "?"}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": 200,
            "ignore_eos": True}
    seen = 0
    with httpx.stream("POST", base + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= events:
                    break
    return seen


def _hang_up_before_answer(base: str) -> None:
    """A non-streamed request whose client gives up (read timeout) long before the answer."""
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(base + CHAT, timeout=httpx.Timeout(60, read=0.2), json={
            "model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand"}], "max_tokens": 200,
            "ignore_eos": True})


def test_clients_hanging_up_mid_stream_leave_nothing_behind(server: ServeProcess) -> None:
    baseline = _kv_baseline(server)
    with ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(_hang_up_stream, server.base, 2 + k % 5, k % 3 == 0) for k in range(12)]
        waits = [pool.submit(_hang_up_before_answer, server.base) for _ in range(4)]
        assert [f.result(120) for f in streams] == [2 + k % 5 for k in range(12)]
        for f in waits:
            f.result(120)
    _idle(server, baseline)
    aborted = sum(v for k, v in server.metrics().items()
                  if k.startswith("flashvlm:request_success_total") and 'finished_reason="abort"' in k)
    assert aborted >= 12  # the engine aborted them rather than running them to the end
    r = httpx.post(server.base + CHAT, timeout=60, json={"model": MODEL, "max_tokens": 3, "ignore_eos": True,
                                                          "messages": [{"role": "user", "content": "still there?"}]})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ---- soak ---------------------------------------------------------------------------------------------------
def _valid_chat(rng: random.Random) -> dict[str, Any]:
    words = " ".join(rng.choice(["cat", "dog", "sky", "red", "one", "très", "日本", "🙂"]) for _ in range(rng.randint(1,
                                                                                                            30)))
    content: Any = words
    if rng.random() < 0.3:
        content = [{"type": "image_url", "image_url": {"url": _uri(_png(rng.randint(0, 20), rng.choice([28, 56])))}},
                   {"type": "text", "text": words}]
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}],
                            "max_tokens": rng.randint(1, 8)}
    if rng.random() < 0.5:
        body.update(temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), seed=rng.randint(0, 99))
    if rng.random() < 0.2:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _valid_completion(rng: random.Random) -> dict[str, Any]:
    prompt: Any = rng.choice(["Once upon a time", "1 2 3", "x" * rng.randint(1, 50)])
    if rng.random() < 0.3:
        prompt = [rng.randint(0, 100) for _ in range(rng.randint(1, 20))]
    return {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 8), "temperature": 0}


_BAD_IMAGES = [
    "data:image/png;base64,!!!notbase64",
    "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(),
    "data:image/png;base64,",
    "data:text/plain;base64,aGVsbG8=",
    "ftp://example.com/x.png",
    "/etc/passwd",
    "http://127.0.0.1:1/x.png",
]


def _bad(rng: random.Random) -> bytes | dict[str, Any]:
    """A body the server must refuse with a 4xx: broken JSON, wrong types, bad images, out-of-range values."""
    ok = _valid_chat(rng)
    truncated_png = _png(rng.randint(0, 9))[: rng.randint(20, 200)]
    choices: list[Any] = [
        json.dumps(ok).encode()[: rng.randint(0, 40)],  # cut off
        b"\xff\xfe\x00garbage",
        b"[1, 2, 3]",
        b"null",
        {**ok, "messages": 5},
        {**ok, "messages": []},
        {**ok, "messages": [{"role": "wizard", "content": "hi"}]},
        {**ok, "messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": "x"}]}]},
        {**ok, "messages": [{"role": "user", "content": "hi \ud800"}]},
        {**ok, "max_tokens": "many"},
        {**ok, "max_tokens": -3},
        {**ok, "temperature": "hot"},
        {**ok, "temperature": float("nan")},
        {**ok, "top_p": 7},
        {**ok, "seed": "x"},
        {**ok, "stop": [1, 2]},
        {**ok, "n": 0},
        {**ok, "stream": "yes"},
        {**ok, "model": ["m"]},
        {**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": rng.choice(_BAD_IMAGES)}}, {"type": "text", "text": "?"}]}]},
        {**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": _uri(truncated_png)}}]}]},
        {**ok, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": _uri(_png(1))}}] * 3}]},  # past --limit-mm-per-prompt
        {"model": MODEL, "prompt": [10**9], "max_tokens": 2},
        {"model": MODEL, "prompt": "", "max_tokens": 2},
        {"model": MODEL, "prompt": {"text": "hi"}},
        {"model": MODEL, "prompt": "hi " * 400, "max_tokens": 2},  # past max_model_len
    ]
    return rng.choice(choices)


def _send(base: str, body: bytes | dict[str, Any]) -> tuple[int, str]:
    path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else CHAT
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.stream("POST", base + path, content=raw, headers={"content-type": "application/json"},
                      timeout=120) as r:
        text = r.read().decode(errors="replace")
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-500:]
        text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                       for line in text.splitlines()
                       if line.startswith("data: {") and json.loads(line[6:])["choices"])
    elif r.status_code == 200:
        choice = json.loads(text)["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
    return r.status_code, text


def test_soak_of_random_requests(server: ServeProcess) -> None:
    rng = random.Random(1234)
    bodies: list[bytes | dict[str, Any]] = []
    for _ in range(SOAK_REQUESTS):
        roll = rng.random()
        bodies.append(_bad(rng) if roll < 0.35 else _valid_completion(rng) if roll < 0.5 else _valid_chat(rng))
    seeded = [{"model": MODEL, "messages": [{"role": "user", "content": f"Pick a word {k}"}], "max_tokens": 6,
               "temperature": 1.0, "seed": 100 + k} for k in range(5)]
    for k, body in enumerate(seeded):  # each twice, at random places, running beside other requests
        for _ in range(2):
            bodies.insert(rng.randrange(len(bodies) + 1), dict(body, messages=list(body["messages"]), tag=k))
    warm = len(bodies) // 3

    def run(batch: list[bytes | dict[str, Any]]) -> list[tuple[int, str]]:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(lambda b: _send(server.base, _untagged(b)), batch))

    results = run(bodies[:warm])
    rss_warm = server.rss_bytes()
    results += run(bodies[warm:])
    rss_end = server.rss_bytes()

    server_errors = [(b if isinstance(b, bytes) else json.dumps(b)[:300], r)
                     for b, r in zip(bodies, results) if r[0] >= 500]
    assert not server_errors, server_errors[:5]
    statuses = {status for status, _ in results}
    assert 200 in statuses and statuses - {200} <= {400, 403, 404}, statuses
    assert sum(status >= 400 for status, _ in results) >= SOAK_REQUESTS // 5
    for k in range(len(seeded)):
        outs = [r for b, r in zip(bodies, results) if isinstance(b, dict) and b.get("tag") == k]
        assert len(outs) == 2 and outs[0] == outs[1] and outs[0][0] == 200, outs
    assert rss_end - rss_warm < RSS_GROWTH_LIMIT, (rss_warm, rss_end)
    wait_for(lambda: server.gauge("num_requests_running") == 0 and server.gauge("num_requests_waiting") == 0,
             "soak requests were left behind")


def _untagged(body: bytes | dict[str, Any]) -> bytes | dict[str, Any]:
    return {k: v for k, v in body.items() if k != "tag"} if isinstance(body, dict) else body


# ---- stalled uploads ----------------------------------------------------------------------------------------
def _stall(base: str, chunked: bool) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if chunked:
        sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n{MIB:x}\r\n".encode() + b" " * MIB + b"\r\n")
    else:
        sock.sendall(f"{head}Content-Length: {8 * MIB}\r\n\r\n".encode() + b'{"model": "m", "pad": "' + b"x" * MIB)
    return sock


def test_stalled_uploads_while_others_are_served(server: ServeProcess) -> None:
    stalled = [_stall(server.base, chunked=k % 2 == 1) for k in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(lambda k: _send(server.base, {
                "model": MODEL, "messages": [{"role": "user", "content": f"hello {k}"}], "max_tokens": 2}), range(12)))
        assert [status for status, _ in served] == [200] * 12
        for sock in stalled:  # each answered 408 once its body has stalled for --body-read-timeout
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply, reply[:300]
    finally:
        for sock in stalled:
            sock.close()
    assert _send(server.base, {"model": MODEL, "prompt": "after", "max_tokens": 2})[0] == 200
