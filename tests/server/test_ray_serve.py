"""`flashvlm serve --ray` on a local Ray cluster (CPU, the embedded demo model), started once for the module: two
replicas behind the front answer the OpenAI client; one image sent 20 times stays on one replica and hits its
encoder cache; a conversation's next turn goes where its first turn ran; a killed replica loses no request that had
not started; autoscaling goes from 1 to 2 replicas under a burst and back, through `build_application`'s layout
(the ingress as a deployment behind Serve's HTTP proxy). Skipped without the [ray] extra."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from flashvlm.server.ray_serve.deployments import (  # noqa: E402
    ENGINE_DEPLOYMENT,
    build_application,
    parse_serve_args,
)
from flashvlm.server.ray_serve.launch import APP_NAME, build_front, deploy  # noqa: E402
from flashvlm.server.ray_serve.options import RayServeOptions  # noqa: E402
from tests.server.conftest import png_bytes  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ENGINE = ENGINE_DEPLOYMENT
FLAGS = ["--device", "cpu", "--served-model-name", "demo", "--max-num-seqs", "8", "--disable-log-requests",
         "--num-processing-threads", "1", "--num-cpus-per-replica", "1"]


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.2)


def free_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """Serve's HTTP proxy, where `build_application`'s all-Serve layout answers."""
    port = free_port()
    # The workers import this checkout's flashvlm, one thread each (2 shared cores).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def two_replicas(base_url: str) -> Iterator[str]:
    """What `flashvlm serve --ray` runs: two engine replicas, and the front (the ingress under our own uvicorn) in
    this process."""
    args = parse_serve_args([*FLAGS, "--num-replicas", "2", "--port", str(free_port())])
    server, front = build_front(args)
    deploy(args, RayServeOptions.from_args(args).validate(), front)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for("the front to listen", lambda: server.started)
    yield f"http://127.0.0.1:{args.port}"
    server.should_exit = True
    thread.join(timeout=30)
    serve.delete(APP_NAME)


def client(base_url: str) -> Any:
    # No client retries: a request the cluster lost must show up as a failure here.
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def chat(base_url: str, messages: list[dict], **kw: Any) -> tuple[str, str]:
    """(reply text, replica that answered)."""
    raw = client(base_url).chat.completions.with_raw_response.create(model="demo", messages=messages, **kw)
    return raw.parse().choices[0].message.content, raw.headers["x-flashvlm-replica"]


def metrics(base_url: str) -> dict[tuple[str, frozenset], float]:
    page = httpx.get(base_url + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(page)
            for s in f.samples}


def value(page: dict, name: str, **labels: str) -> float:
    """The sum of `name` over the samples whose labels include `labels`."""
    return sum(v for (n, ls), v in page.items() if n == name and set(labels.items()) <= ls)


def image_uri(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(56, 56, seed=seed)).decode()


def test_two_replicas_serve_the_openai_client(two_replicas: str) -> None:
    c = client(two_replicas)
    assert [m.id for m in c.models.list().data]
    seen = set()
    for i in range(30):  # no shared key: least loaded, equal loads in random order, so both are used
        text, replica = chat(two_replicas, [{"role": "user", "content": f"hello {i}"}], max_tokens=2)
        assert isinstance(text, str)
        seen.add(replica)
        if len(seen) == 2:
            break
    assert len(seen) == 2
    stream = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "count"}],
                                       max_tokens=4, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    # The replica's own errors come through as they are.
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    # A body past the 4 MiB message cap of Serve's gRPC path still reaches the replica (as an actor call): its
    # own 400, not the front's 500.
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=-1,
                                  user="u" * (5 << 20))
    # The client's request id comes back, as from `flashvlm serve`.
    raw = c.chat.completions.with_raw_response.create(model="demo", messages=[{"role": "user", "content": "x"}],
                                                      max_tokens=1, extra_headers={"x-request-id": "client-7"})
    assert raw.headers["x-request-id"] == "client-7"
    # Headers reach the replica's app: an SLA tier by header, and an unknown one refused there.
    tiered = c.chat.completions.with_raw_response.create(model="demo", messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=1, extra_headers={"x-sla-tier": "gold"})
    assert tiered.status_code == 200
    with pytest.raises(openai.BadRequestError, match="unknown SLA tier"):
        c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                  extra_headers={"x-sla-tier": "platinum"})
    page = metrics(two_replicas)
    assert len({dict(ls)["replica"] for (n, ls) in page if n == "flashvlm:num_requests_running"}) == 2
    # A client that leaves mid-stream aborts its request on the replica, two hops away.
    body = {"model": "demo", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", two_replicas + "/v1/chat/completions", json=body, timeout=60) as r:
        left = r.headers["x-flashvlm-replica"]
        assert next(line for line in r.iter_lines() if line.startswith("data:"))
    wait_for("the abandoned stream to be aborted", lambda: value(
        metrics(two_replicas), "flashvlm:request_success_total", replica=left, finished_reason="abort") >= 1)
    assert value(metrics(two_replicas), "flashvlm:num_requests_running", replica=left) == 0


def test_one_image_twenty_times_stays_on_one_replica_and_hits_its_encoder_cache(two_replicas: str) -> None:
    uri = image_uri(seed=20)
    replicas = []
    for i in range(20):
        # The text before the image differs, so the KV prefix cache cannot skip the image: the encoder cache must.
        messages = [{"role": "user", "content": [{"type": "text", "text": f"question {i}:"},
                                                 {"type": "image_url", "image_url": {"url": uri}},
                                                 {"type": "text", "text": "what colour?"}]}]
        replicas.append(chat(two_replicas, messages, max_tokens=2)[1])
    assert len(set(replicas)) == 1
    page = metrics(two_replicas)
    assert value(page, "flashvlm:encoder_cache_hits_total", replica=replicas[0]) >= 19
    assert value(page, "flashvlm:router_decisions_total", decision="image_hit", replica=replicas[0]) >= 19


def test_a_conversations_next_turn_goes_where_its_first_turn_ran(two_replicas: str) -> None:
    hits_before = value(metrics(two_replicas), "flashvlm:router_decisions_total", decision="prefix_hit")
    for n in range(4):
        first = [{"role": "user", "content": f"conversation {n}: tell me about the shapes and their colours, "
                                             f"the words printed on them and where they sit. " * 2}]
        reply, where = chat(two_replicas, first, max_tokens=4)
        follow = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        assert chat(two_replicas, follow, max_tokens=2)[1] == where
    hits = value(metrics(two_replicas), "flashvlm:router_decisions_total", decision="prefix_hit") - hits_before
    assert hits >= 4


def test_a_killed_replica_loses_no_request_that_had_not_started(two_replicas: str) -> None:
    uri = image_uri(seed=7)  # one image: every request below prefers the same replica
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                             {"type": "text", "text": "describe"}]}]
    c = client(two_replicas)
    stream = c.chat.completions.with_streaming_response.create(model="demo", messages=messages, max_tokens=1500,
                                                               extra_body={"ignore_eos": True}, stream=True)
    response = stream.__enter__()
    victim = response.headers["x-flashvlm-replica"]
    events = response.iter_lines()
    assert next(e for e in events if e.startswith("data:"))  # the stream is under way on `victim`

    results: dict[int, Any] = {}

    def one(i: int) -> None:
        try:
            results[i] = chat(two_replicas, messages, max_tokens=300, extra_body={"ignore_eos": True})
        except Exception as e:  # recorded, asserted below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    wait_for("the requests to run on the victim", lambda: value(
        metrics(two_replicas), "flashvlm:num_requests_running", replica=victim) >= 5, timeout_s=30)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#{ENGINE}#{victim}", namespace="serve"), no_restart=True)

    rest = "\n".join(events)
    stream.__exit__(None, None, None)
    assert '"code": "replica_lost"' in rest and rest.rstrip().endswith("data: [DONE]")
    for t in threads:
        t.join(timeout=60)
    assert all(isinstance(r, tuple) for r in results.values()), results
    assert len(results) == 4 and all(replica != victim for _, replica in results.values())
    page = metrics(two_replicas)
    assert value(page, "flashvlm:router_resent_requests_total") >= 4
    assert value(page, "flashvlm:router_lost_streams_total") >= 1
    for i in range(3):  # and the service goes on
        assert chat(two_replicas, [{"role": "user", "content": f"after {i}"}], max_tokens=2)[1] != victim


def test_autoscaling_from_one_to_two_replicas_under_a_burst_and_back(base_url: str) -> None:
    flags = [*FLAGS, "--num-replicas", "1", "--min-replicas", "1", "--max-replicas", "2",
             "--target-ongoing-requests", "2", "--upscale-delay", "1", "--downscale-delay", "2"]
    serve.run(build_application(flags), name=APP_NAME, route_prefix="/")
    try:
        def running() -> int:
            states = serve.status().applications[APP_NAME].deployments[ENGINE].replica_states
            return states.get("RUNNING", 0)

        assert running() == 1
        stop = threading.Event()

        def burst() -> None:  # long streams, closed once the second replica is up
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 1500,
                            "ignore_eos": True, "stream": True}
                    with http.stream("POST", base_url + "/v1/chat/completions", json=body) as r:
                        for _ in r.iter_lines():
                            if stop.is_set():
                                break

        threads = [threading.Thread(target=burst) for _ in range(6)]
        for t in threads:
            t.start()
        try:
            wait_for("a second replica", lambda: running() == 2, timeout_s=90)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        wait_for("the deployment to shrink back to one replica", lambda: running() == 1, timeout_s=60)
    finally:
        serve.delete(APP_NAME)
