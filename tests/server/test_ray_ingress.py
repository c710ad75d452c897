"""The Ray Serve ingress over a scripted engine handle (no cluster): what it does when a replica is lost before
answering, mid-stream, or answers that its engine is dead; and that it counts the router's decisions."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("ray.serve")
from ray.exceptions import RayActorError  # noqa: E402
from starlette.requests import Request  # noqa: E402

from flashvlm.server.ray_serve.affinity import RouteTicket  # noqa: E402
from flashvlm.server.ray_serve.asgi_bridge import ResponseStart  # noqa: E402
from flashvlm.server.ray_serve.deployments import MAX_ATTEMPTS, Ingress, IngressSettings  # noqa: E402

JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


class FakeStream:
    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if not self.parts:
            raise StopAsyncIteration
        part = self.parts.pop(0)
        if isinstance(part, BaseException):
            raise part
        return part

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Plays the handle and its router: attempt i goes to replica f"r{i}" and answers script(i)."""

    def __init__(self, script: Callable[[int], list[Any]]) -> None:
        self.script = script
        self.tickets: list[RouteTicket] = []
        self.streams: list[FakeStream] = []
        self.handle = self

    def options(self, **_: Any) -> FakeHandle:
        return self

    def remote(self, ticket: RouteTicket, forwarded: Any) -> FakeStream:
        i = len(self.tickets)
        ticket.replica, ticket.known_replicas = f"r{i}", [f"r{i}"]
        self.tickets.append(ticket)
        self.streams.append(FakeStream(self.script(i)))
        return self.streams[-1]


def post(body: dict) -> Request:
    data = json.dumps(body).encode()
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "query_string": b"",
             "headers": [(b"content-length", str(len(data)).encode())], "client": ("127.0.0.1", 1)}
    return Request(scope, receive)


def serve_one(script: Callable[[int], list[Any]]) -> tuple[Any, FakeHandle, Ingress]:
    handle = FakeHandle(script)
    ingress = Ingress(handle, IngressSettings(block_chars=16, max_body_bytes_in_flight=1 << 20,
                                              body_read_timeout_s=5.0))
    response = asyncio.run(ingress(post({"messages": [{"role": "user", "content": "hi"}]})))
    return response, handle, ingress


def counter(ingress: Ingress, name: str, **labels: str) -> float:
    return ingress.registry.get_sample_value(name, labels) or 0.0


def lost() -> RayActorError:
    return RayActorError()


def test_a_request_lost_before_its_answer_is_sent_again_elsewhere() -> None:
    ok = [ResponseStart(200, [*JSON, (b"x-flashvlm-replica", b"r1")]), b'{"ok": true}']
    response, handle, ingress = serve_one(lambda i: [lost()] if i == 0 else list(ok))
    assert response.status_code == 200 and json.loads(response.body) == {"ok": True}
    assert handle.tickets[1].exclude == ("r0",)  # not sent back to the lost replica
    assert handle.streams[0].cancelled
    assert counter(ingress, "flashvlm:router_resent_requests_total") == 1
    assert counter(ingress, "flashvlm:router_decisions_total", decision="least_loaded", replica="r1") == 1


def test_a_replica_whose_engine_is_dead_counts_as_lost() -> None:
    dead = json.dumps({"error": {"message": "the engine is not running", "type": "service_unavailable",
                                 "param": None, "code": "engine_dead"}}).encode()
    response, handle, _ = serve_one(lambda i: [ResponseStart(503, JSON), dead] if i == 0 else
                                    [ResponseStart(200, JSON), b"{}"])
    assert response.status_code == 200 and len(handle.tickets) == 2
    # Any other error of the replica's app is the answer, not a reason to try elsewhere.
    bad = json.dumps({"error": {"message": "no", "type": "invalid_request_error", "param": None,
                                "code": "invalid_request"}}).encode()
    response, handle, _ = serve_one(lambda i: [ResponseStart(400, JSON), bad])
    assert response.status_code == 400 and len(handle.tickets) == 1


def test_every_attempt_lost_is_a_503() -> None:
    response, handle, _ = serve_one(lambda i: [lost()])
    assert response.status_code == 503 and len(handle.tickets) == MAX_ATTEMPTS
    assert json.loads(response.body)["error"]["code"] == "replica_lost"
    assert handle.tickets[-1].exclude == tuple(f"r{i}" for i in range(MAX_ATTEMPTS - 1))


def test_a_stream_cut_by_a_lost_replica_ends_with_an_error_event() -> None:
    response, handle, ingress = serve_one(lambda i: [ResponseStart(200, SSE), b"data: {\"a\": 1}\n\n", lost()])

    async def read() -> bytes:
        return b"".join([chunk async for chunk in response.body_iterator])

    body = asyncio.run(read()).decode()
    events = [e for e in body.split("\n\n") if e]
    assert events[0] == 'data: {"a": 1}'
    assert json.loads(events[1][len("data: "):])["error"]["code"] == "replica_lost"
    assert events[2] == "data: [DONE]"
    assert len(handle.tickets) == 1  # a stream under way is never sent again
    assert counter(ingress, "flashvlm:router_lost_streams_total") == 1


def test_replica_health_is_the_engines() -> None:
    from types import SimpleNamespace

    from flashvlm.server.ray_serve.deployments import EngineReplica

    replica = EngineReplica.__new__(EngineReplica)  # without the engine build: only its health check is tested
    replica._engine = SimpleNamespace(is_alive=True)
    replica.check_health()
    replica._engine.is_alive = False
    with pytest.raises(RuntimeError, match="engine is not running"):
        replica.check_health()
    replica._engine = None
