"""The serve-scenario load generator against the fake OpenAI server on loopback: wire format, timing, limits, errors."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from flashvlm.bench.loadgen import endpoint_url, run_load_sync
from flashvlm.bench.records import BenchRequest
from flashvlm.testing.fake_openai_server import FakeOpenAIServer

MODEL = "fake-model"


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = set(threading.enumerate())
    yield
    # tqdm's monitor is a process-wide daemon that tqdm owns and reuses; anything else is ours and must be gone.
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and t.name != "tqdm_monitor"]
    assert not leaked, f"threads left running: {leaked}"


def make_requests(n: int, *, images_per_request: int = 2, seed: int = 0) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    # Fewer arrays than image slots, so requests share arrays as repeated-image workloads do.
    pool = [rng.integers(0, 256, size=(int(rng.integers(28, 57)), int(rng.integers(28, 57)), 3), dtype=np.uint8)
            for _ in range(7)]
    return [BenchRequest(request_id=f"r{i}", prompt=f"describe picture number {i}",
                         images=[pool[(i + k) % len(pool)] for k in range(i % (images_per_request + 1))],
                         max_tokens=3 + i % 10)
            for i in range(n)]


def decode_data_uri(url: str) -> np.ndarray:
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix), url[:40]
    data = base64.b64decode(url[len(prefix):], validate=True)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return np.asarray(Image.open(io.BytesIO(data)))


def by_prompt(server: FakeOpenAIServer) -> dict[str, tuple[dict, float]]:
    """Received bodies (and arrival times) keyed by their text part, since arrival order is not request order."""
    out = {}
    for body, t in zip(server.received, server.arrival_times):
        parts = body["messages"][0]["content"] if "messages" in body else [{"type": "text", "text": body["prompt"]}]
        text = next(p["text"] for p in parts if p["type"] == "text")
        out[text] = (body, t)
    return out


def test_chat_with_images():
    reqs = make_requests(20)
    with FakeOpenAIServer(tokens_per_request=8, token_delay_s=0.001) as server:
        records, duration = run_load_sync(server.base_url, MODEL, reqs, progress=False,
                                          extra_body={"ignore_eos": True})
        received = by_prompt(server)
    assert [r.request_id for r in records] == [q.request_id for q in reqs]
    assert len(received) == 20
    for req, rec in zip(reqs, records):
        assert rec.success, rec.error
        assert rec.error is None
        expected = min(req.max_tokens, 8)
        assert rec.output_tokens == expected
        assert len(rec.itl) == expected - 1  # the fake server sends one content chunk per token
        assert 0 < rec.ttft <= rec.e2e <= duration
        assert all(g >= 0 for g in rec.itl)
        assert rec.ttft + sum(rec.itl) <= rec.e2e
        assert rec.num_images == len(req.images)
        assert rec.prompt_tokens == len(req.prompt.split()) + 16 * len(req.images)  # as the server's usage says
        assert rec.start_time > 0
        body, _ = received[req.prompt]
        assert body["model"] == MODEL and body["stream"] is True and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == req.max_tokens and body["ignore_eos"] is True
        parts = body["messages"][0]["content"]
        assert [p["type"] for p in parts] == ["image_url"] * len(req.images) + ["text"]
        for part, image in zip(parts, req.images):
            np.testing.assert_array_equal(decode_data_uri(part["image_url"]["url"]), image)
    assert sum(server.images_per_request) == sum(len(q.images) for q in reqs)


def test_max_concurrency_bounds_in_flight():
    reqs = make_requests(12, images_per_request=1)
    with FakeOpenAIServer(tokens_per_request=6, token_delay_s=0.002) as server:
        records, _ = run_load_sync(server.base_url, MODEL, reqs, max_concurrency=2, progress=False)
    assert all(r.success for r in records)
    assert server.max_in_flight == 2


def test_unbounded_sends_all_at_once():
    reqs = make_requests(8, images_per_request=0)
    with FakeOpenAIServer(tokens_per_request=2, first_token_delay_s=0.2) as server:
        records, duration = run_load_sync(server.base_url, MODEL, reqs, progress=False)
    assert all(r.success for r in records)
    assert server.max_in_flight >= 4  # all were sent together; they overlap on a server that takes 0.2 s each
    assert duration < 8 * 0.2  # and so did not run one after another


def test_arrival_offsets_respected():
    reqs = make_requests(10, images_per_request=1)
    offsets = [0.05, 0.0, 0.03, 0.01, 0.045, 0.02, 0.0, 0.035, 0.015, 0.04]  # not sorted on purpose
    t_before = time.time()
    with FakeOpenAIServer(tokens_per_request=3) as server:
        records, duration = run_load_sync(server.base_url, MODEL, reqs, arrival_offsets=offsets, progress=False)
        received = by_prompt(server)
    for req, rec, off in zip(reqs, records, offsets):
        assert rec.success, rec.error
        assert rec.start_time >= t_before + off
        assert received[req.prompt][1] >= t_before + off
        assert rec.start_time < t_before + off + 1.0
    first = min(r.start_time for r in records)
    assert max(r.start_time for r in records) - first >= 0.05 - 1e-3
    assert duration >= 0.05 - 1e-3


def test_arrival_offsets_must_match_requests():
    with pytest.raises(ValueError, match="arrival offsets"):
        run_load_sync("http://127.0.0.1:1", MODEL, make_requests(3), arrival_offsets=[0.0], progress=False)


def test_failed_requests_are_recorded():
    reqs = make_requests(20, images_per_request=1)
    with FakeOpenAIServer(tokens_per_request=4, fail_every=4) as server:
        records, _ = run_load_sync(server.base_url, MODEL, reqs, max_concurrency=3, progress=False)
    failed = [r for r in records if not r.success]
    assert len(failed) == 5
    for r in failed:
        assert "HTTP 500" in r.error and "injected failure" in r.error
        assert r.e2e is None
    for req, r in zip(reqs, records):
        if r.success:
            assert r.output_tokens == min(req.max_tokens, 4) and r.error is None


def test_malformed_stream_gives_error_record():
    reqs = make_requests(9, images_per_request=0)
    with FakeOpenAIServer(tokens_per_request=5, malformed_every=3) as server:
        records, _ = run_load_sync(server.base_url, MODEL, reqs, max_concurrency=2, progress=False)
    failed = [r for r in records if not r.success]
    assert len(failed) == 3
    assert all("malformed SSE data" in r.error for r in failed)
    assert sum(r.success for r in records) == 6


def test_completions_endpoint():
    reqs = [BenchRequest(request_id=f"c{i}", prompt=f"count to {i}", images=[], max_tokens=2 + i) for i in range(6)]
    with FakeOpenAIServer(tokens_per_request=5, token_text=" word") as server:
        # Base URL given with /v1, as OpenAI clients take it; progress on to exercise the bar.
        records, _ = run_load_sync(server.base_url + "/v1", MODEL, reqs, endpoint="completions", progress=True)
        bodies = list(server.received)
    assert all(r.success for r in records), [r.error for r in records]
    assert [r.output_tokens for r in records] == [min(2 + i, 5) for i in range(6)]
    assert all(len(r.itl) == r.output_tokens - 1 for r in records)
    assert all("prompt" in b and "messages" not in b and b["stream"] for b in bodies)


def test_images_on_completions_endpoint_is_a_request_error():
    reqs = make_requests(3, images_per_request=1)  # only r1 has an image
    with FakeOpenAIServer(tokens_per_request=2) as server:
        records, _ = run_load_sync(server.base_url, MODEL, reqs, endpoint="completions", progress=False)
    assert records[0].success and records[2].success
    assert not records[1].success and "cannot carry images" in records[1].error
    assert len(server.received) == 2


def test_without_usage_counts_chunks():
    reqs = make_requests(4, images_per_request=0)
    reqs[0].prompt_token_ids = [1, 2, 3]
    with FakeOpenAIServer(tokens_per_request=4) as server:
        records, _ = run_load_sync(server.base_url, MODEL, reqs, progress=False,
                                   extra_body={"stream_options": {"include_usage": False}})
    assert [r.output_tokens for r in records] == [min(q.max_tokens, 4) for q in reqs]
    assert records[0].prompt_tokens == 3 and records[1].prompt_tokens == 0  # no usage: only what the request knew


def test_timeout_and_connection_refused_are_errors():
    reqs = make_requests(2, images_per_request=0)
    with FakeOpenAIServer(tokens_per_request=2, first_token_delay_s=0.3) as server:
        records, _ = run_load_sync(server.base_url, MODEL, reqs, timeout_s=0.05, progress=False)
    assert all(not r.success and "time" in r.error.lower() for r in records), [r.error for r in records]

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    records, duration = run_load_sync(f"http://127.0.0.1:{port}", MODEL, reqs, progress=False)
    assert all(not r.success and "Connect" in r.error for r in records), [r.error for r in records]
    assert duration >= 0


def test_endpoint_url():
    assert endpoint_url("http://h:1", "chat") == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1/v1/", "completions") == "http://h:1/v1/completions"
    with pytest.raises(ValueError):
        endpoint_url("http://h:1", "embeddings")  # type: ignore[arg-type]


def test_fake_server_non_streaming_and_models():
    with FakeOpenAIServer(tokens_per_request=3, token_text="ab", model="m") as server, \
            httpx.Client(base_url=server.base_url) as client:
        models = client.get("/v1/models").json()
        assert models["data"][0]["id"] == "m"
        chat = client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}},
                                                      {"type": "text", "text": "hi there"}]}]}).json()
        assert chat["choices"][0]["message"]["content"] == "abab"
        assert chat["usage"] == {"prompt_tokens": 2 + 16, "completion_tokens": 2, "total_tokens": 20}
        comp = client.post("/v1/completions", json={"model": "m", "prompt": "x"}).json()
        assert comp["choices"][0]["text"] == "ababab"
        assert client.post("/v1/nope", json={}).status_code == 404
        assert client.post("/v1/completions", content=b"{bad").status_code == 400
        assert server.images_per_request == [1, 0]
