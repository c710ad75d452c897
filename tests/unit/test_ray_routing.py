"""The pieces of `flashvlm serve --ray` that are plain Python (no ray needed): routing keys, the router's choice and
its bounded memory, the options and the Serve config they give, the ASGI bridge and the merged metrics page."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from flashvlm.server.ray_serve.affinity import AffinityTable, RouteTicket, rank_replicas
from flashvlm.server.ray_serve.keys import NO_KEYS, RoutingKeys, routing_keys
from flashvlm.server.ray_serve.options import RayServeOptions

CHAT = "/v1/chat/completions"
BLOCK = 16


def chat_body(messages: list[dict]) -> bytes:
    return json.dumps({"messages": messages, "max_tokens": 4}).encode()


def image_part(payload: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(payload).decode()}}


def user(*parts: dict | str) -> dict:
    return {"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}


# ---- routing keys ------------------------------------------------------------------------------------------------
def test_same_image_same_key_whatever_the_text() -> None:
    a = routing_keys(CHAT, chat_body([user("first question", image_part(b"img-1"))]), BLOCK)
    b = routing_keys(CHAT, chat_body([user("another one", image_part(b"img-1"))]), BLOCK)
    c = routing_keys(CHAT, chat_body([user("first question", image_part(b"img-2"))]), BLOCK)
    assert len(a.images) == 1 and a.images == b.images
    assert a.images != c.images
    twice = routing_keys(CHAT, chat_body([user(image_part(b"img-1"), image_part(b"img-1"))]), BLOCK)
    assert twice.images == a.images  # distinct images only


def test_follow_up_turn_shares_the_first_turns_prefix_keys() -> None:
    first = [user("please describe the picture of the red square on the left " * 3)]
    turn1 = routing_keys(CHAT, chat_body(first), BLOCK)
    follow = first + [{"role": "assistant", "content": "a red square"}, user("and its size?")]
    turn2 = routing_keys(CHAT, chat_body(follow), BLOCK)
    assert len(turn1.prefix) >= 5
    assert turn2.prefix[:len(turn1.prefix)] == turn1.prefix
    other = routing_keys(CHAT, chat_body([user("a different conversation altogether, about a circle " * 3)]), BLOCK)
    assert not set(other.prefix) & set(turn1.prefix)


def test_prefix_keys_are_cumulative() -> None:
    # Same second block after a different first block: a different key (key i covers blocks 0..i).
    a = routing_keys("/v1/completions", json.dumps({"prompt": "A" * BLOCK + "B" * BLOCK}).encode(), BLOCK)
    b = routing_keys("/v1/completions", json.dumps({"prompt": "C" * BLOCK + "B" * BLOCK}).encode(), BLOCK)
    assert len(a.prefix) == len(b.prefix) == 2 and a.prefix[1] != b.prefix[1]


def test_no_keys_for_short_prompts_other_routes_and_bad_bodies() -> None:
    assert routing_keys(CHAT, chat_body([user("hi")]), 128).prefix == ()
    assert routing_keys("/v1/models", b"", BLOCK) is NO_KEYS
    assert routing_keys(CHAT, b"{not json", BLOCK) is NO_KEYS
    assert routing_keys(CHAT, b"[1, 2]", BLOCK) is NO_KEYS
    assert routing_keys(CHAT, json.dumps({"messages": "nope"}).encode(), BLOCK).empty
    assert routing_keys(CHAT, json.dumps({"messages": [{"role": "user", "content": [7, None]}]}).encode(), BLOCK)


# ---- the choice --------------------------------------------------------------------------------------------------
def keys(*images: int, prefix: tuple[int, ...] = ()) -> RoutingKeys:
    return RoutingKeys(prefix=prefix, images=images)


def test_no_known_key_goes_to_the_least_loaded() -> None:
    table = AffinityTable(16)
    ticket = RouteTicket(keys(1))
    ranks = rank_replicas(ticket, {"a": 3, "b": 0, "c": 1}, table, max_imbalance=2)
    assert ranks == [["b", "c", "a"]]
    assert ticket.preferred is None
    ticket.replica = "b"
    assert ticket.decision() == "least_loaded"


def test_equal_loads_are_tried_in_random_order() -> None:
    rng = random.Random(0)
    firsts = {rank_replicas(RouteTicket(), {"a": 0, "b": 0}, AffinityTable(4), 2, rng)[0][0] for _ in range(40)}
    assert firsts == {"a", "b"}


def test_known_image_goes_to_its_replica_within_the_load_bound() -> None:
    table = AffinityTable(16)
    table.remember(keys(7), "a")
    ticket = RouteTicket(keys(7))
    assert rank_replicas(ticket, {"a": 4, "b": 2}, table, max_imbalance=2) == [["a"], ["b"]]
    assert (ticket.preferred, ticket.reason) == ("a", "image")
    ticket.replica = "a"
    assert ticket.decision() == "image_hit"
    # One more request on "a" than the bound allows: fall back to the others, "a" last.
    over = RouteTicket(keys(7))
    assert rank_replicas(over, {"a": 5, "b": 2}, table, max_imbalance=2) == [["b"], ["a"]]
    over.replica = "b"
    assert over.decision() == "fallback"


def test_longest_prefix_wins_over_images() -> None:
    table = AffinityTable(16)
    table.remember(keys(prefix=(10, 11)), "a")
    table.remember(keys(prefix=(10, 11, 12)), "b")
    table.remember(keys(99), "c")
    ticket = RouteTicket(keys(99, prefix=(10, 11, 12, 13)))
    assert rank_replicas(ticket, {"a": 0, "b": 0, "c": 0}, table, 8)[0] == ["b"]
    assert ticket.reason == "prefix"
    ticket.replica = "b"
    assert ticket.decision() == "prefix_hit"


def test_most_images_wins_and_gone_replicas_are_ignored() -> None:
    table = AffinityTable(16)
    table.remember(keys(1), "a")
    table.remember(keys(2, 3), "b")
    assert rank_replicas(RouteTicket(keys(1, 2, 3)), {"a": 0, "b": 0}, table, 8)[0] == ["b"]
    # "b" is gone: its keys are ignored, not mistaken for a choice.
    assert rank_replicas(RouteTicket(keys(1, 2, 3)), {"a": 0, "c": 0}, table, 8)[0] == ["a"]
    ticket = RouteTicket(keys(2, 3))
    assert rank_replicas(ticket, {"a": 1, "c": 0}, table, 8) == [["c", "a"]] and ticket.preferred is None


def test_excluded_replica_is_avoided_unless_it_is_the_only_one() -> None:
    table = AffinityTable(16)
    table.remember(keys(5), "a")
    ticket = RouteTicket(keys(5), exclude=("a",))
    assert rank_replicas(ticket, {"a": 0, "b": 3}, table, 8) == [["b"]]
    assert rank_replicas(RouteTicket(keys(5), exclude=("a",)), {"a": 0}, table, 8) == [["a"]]


def test_pinned_goes_there_or_nowhere() -> None:
    table = AffinityTable(4)
    ticket = RouteTicket(pin="b")
    assert rank_replicas(ticket, {"a": 0, "b": 9}, table, 0) == [["b"]]
    assert rank_replicas(RouteTicket(pin="z"), {"a": 0}, table, 0) == []
    assert ticket.decision() == "pinned"


def test_a_hot_image_spreads_within_the_bound() -> None:
    """Forty concurrent requests for one image (none finishes): routed as Serve does (the least loaded of the first
    rank), the load never strays more than the bound from even, and every replica ends up holding the image."""
    table, bound = AffinityTable(64), 3
    loads = {"a": 0, "b": 0, "c": 0}
    rng = random.Random(1)
    for _ in range(40):
        ticket = RouteTicket(keys(42))
        first = rank_replicas(ticket, loads, table, bound, rng)[0]
        chosen = min(first, key=lambda r: loads[r])
        loads[chosen] += 1
        table.remember(ticket.keys, chosen)
        assert max(loads.values()) - min(loads.values()) <= bound + 1
    assert min(loads.values()) >= 40 // 3 - bound


def test_the_table_forgets_least_recently_routed_keys_first() -> None:
    table = AffinityTable(3)
    table.remember(keys(1, 2), "a")
    table.remember(keys(3), "b")
    table.remember(keys(1), "a")  # 1 is fresh again; 2 is now the oldest
    table.remember(keys(4), "b")
    assert len(table) == 3
    assert table.owner(2) is None and table.owner(1) == "a" and table.owner(4) == "b"
    for key in range(100, 1100):
        table.remember(keys(key), "c")
    assert len(table) == 3
    with pytest.raises(ValueError):
        AffinityTable(0)


# ---- options ------------------------------------------------------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    from flashvlm.server.cli import build_parser

    parser = argparse.ArgumentParser()
    build_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_flags_and_the_serve_config_they_give() -> None:
    args = parse("--ray", "--num-replicas", "2")
    assert args.ray and args.num_replicas == 2
    fixed = RayServeOptions.from_args(args).validate()
    out = fixed.deployment_options(max_num_seqs=8, max_waiting_requests=10, use_gpu=True)
    assert out["num_replicas"] == 2 and "autoscaling_config" not in out
    assert out["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert out["max_ongoing_requests"] == 8 + 2 * 10

    args = parse("--min-replicas", "1", "--max-replicas", "3", "--upscale-delay", "2", "--num-gpus-per-replica", "0.5")
    auto = RayServeOptions.from_args(args).validate()
    out = auto.deployment_options(max_num_seqs=8, max_waiting_requests=10, use_gpu=True)
    assert "num_replicas" not in out and out["ray_actor_options"]["num_gpus"] == 0.5
    cfg = out["autoscaling_config"]
    assert (cfg["min_replicas"], cfg["max_replicas"], cfg["initial_replicas"]) == (1, 3, 1)
    assert cfg["target_ongoing_requests"] == 8  # --max-num-seqs by default
    assert cfg["upscale_delay_s"] == 2.0 and cfg["downscale_delay_s"] == 120.0
    assert cfg["metrics_interval_s"] <= 2.0 and cfg["look_back_period_s"] <= 30.0
    targeted = RayServeOptions(max_replicas=2, target_ongoing_requests=3).validate()
    assert targeted.autoscaling_config(8)["target_ongoing_requests"] == 3
    assert RayServeOptions().deployment_options(8, 10, use_gpu=False)["ray_actor_options"]["num_gpus"] == 0.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_replicas": 0}, "--num-replicas must be >= 1"),
    ({"min_replicas": 3, "max_replicas": 2}, "--min-replicas 3 is above --max-replicas 2"),
    ({"num_replicas": 5, "max_replicas": 2}, "--num-replicas 5 must lie between"),
    ({"upscale_delay": -1.0}, "--upscale-delay must be a number >= 0"),
    ({"num_gpus_per_replica": -0.5}, "--num-gpus-per-replica must be a number >= 0"),
    ({"router_max_keys": 0}, "--router-max-keys must be >= 1"),
    ({"stream_batching_interval_ms": -5.0}, "--stream-batching-interval-ms must be a number >= 0"),
])
def test_bad_options_are_refused_by_flag(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RayServeOptions(**kwargs).validate()


def test_ray_client_addresses_given_or_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not RayServeOptions().through_ray_client
    assert not RayServeOptions(ray_address="head:6379").through_ray_client
    assert RayServeOptions(ray_address="ray://head:10001").through_ray_client
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert RayServeOptions().through_ray_client


def test_the_docs_table_is_the_fields() -> None:
    from flashvlm.server.ray_serve.options import DOCS_PAGE, with_ray_options_table

    page = DOCS_PAGE.read_text()
    assert with_ray_options_table(page) == page, \
        "docs/distributed.md's options table is stale: python -m flashvlm.server.ray_serve.options"


# ---- the ASGI bridge and the merged metrics -------------------------------------------------------------------------
def test_bridge_replays_a_request_and_streams_its_response() -> None:
    pytest.importorskip("starlette", reason="the ASGI bridge serves the [serve] extra's app")
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from flashvlm.server.ray_serve.asgi_bridge import MAX_ITEM_BYTES, ForwardedRequest, ResponseStart, run_asgi
    from flashvlm.server.sse import SSEResponse  # the server's streams, which close on a disconnect

    seen: dict[str, object] = {}

    async def echo(request: Request) -> JSONResponse:
        return JSONResponse({"body": (await request.body()).decode(), "q": request.url.query}, status_code=201)

    async def stream(request: Request) -> SSEResponse:
        gap = float(request.query_params.get("gap", 0))

        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(gap)
            finally:
                seen["closed"] = True

        return SSEResponse(events())

    async def burst(request: Request) -> SSEResponse:
        async def events():
            for i in range(50):
                yield f"data: {i}\n\n"

        return SSEResponse(events())

    async def paced(request: Request) -> SSEResponse:
        async def events():
            for i in range(20):
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.002)

        return SSEResponse(events())

    async def failing(request: Request) -> SSEResponse:
        async def events():
            for i in range(3):
                yield f"data: {i}\n\n"
            await asyncio.sleep(0.01)  # inside the next item's batching wait
            raise RuntimeError("the app broke mid-stream")

        return SSEResponse(events())

    async def big(request: Request) -> JSONResponse:
        return JSONResponse({"text": "x" * (3 * MAX_ITEM_BYTES)})

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream),
                            Route("/burst", burst), Route("/paced", paced), Route("/failing", failing),
                            Route("/big", big)])

    async def main() -> None:
        parts = [p async for p in run_asgi(app, ForwardedRequest("POST", "/echo", b"x=1", (), b"hello"),
                                           ((b"x-flashvlm-replica", b"r1"),))]
        start = parts[0]
        assert isinstance(start, ResponseStart) and start.status == 201 and not start.is_event_stream
        assert start.header(b"x-flashvlm-replica") == b"r1"
        assert json.loads(b"".join(parts[1:])) == {"body": "hello", "q": "x=1"}

        gen = run_asgi(app, ForwardedRequest("GET", "/stream"))
        start = await gen.__anext__()
        assert start.is_event_stream
        assert await gen.__anext__() == b"data: 0\n\n"
        await gen.aclose()  # the caller left mid-stream: the app's generator is closed, not left running
        assert seen.get("closed") is True

        # A caller slower than the app takes what piled up as one item, every event whole and in order.
        gen = run_asgi(app, ForwardedRequest("GET", "/burst"))
        assert (await gen.__anext__()).is_event_stream
        await asyncio.sleep(0.05)
        rest = [p async for p in gen]
        assert b"".join(rest) == "".join(f"data: {i}\n\n" for i in range(50)).encode()
        assert len(rest) < 50

        # With a batching interval the head goes at once, one event each; the rest, paced slower than the caller
        # reads, waits for company, and the response's end sends it without waiting out the 30 s interval.
        events = [f"data: {i}\n\n" for i in range(20)]
        for interval, most in ((0.0, None), (30.0, 3)):
            gen = run_asgi(app, ForwardedRequest("GET", "/paced"), batching_interval_s=interval)
            assert (await gen.__anext__()).is_event_stream
            rest = await asyncio.wait_for(_take_all(gen), 10)
            assert b"".join(rest) == "".join(events).encode()
            if most is None:
                assert len(rest) > 3  # as they come
            else:
                assert rest[:2] == [events[0].encode(), events[1].encode()] and len(rest) == most

        # An app that fails while the next item waits out its interval: what it sent arrives, then the error.
        gen = run_asgi(app, ForwardedRequest("GET", "/failing"), batching_interval_s=30.0)
        got: list[Any] = []
        with pytest.raises(Exception) as failure:  # the app's error, inside the SSE task group's group
            while True:
                got.append(await asyncio.wait_for(gen.__anext__(), 10))
        causes = getattr(failure.value, "exceptions", [failure.value])
        assert any("broke mid-stream" in str(c) for c in causes)
        assert b"".join(got[1:]) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"

        # A caller that leaves during the wait closes the app's stream, as a disconnect does.
        seen.pop("closed")
        gen = run_asgi(app, ForwardedRequest("GET", "/stream", b"gap=0.01"), batching_interval_s=30.0)
        for _ in range(3):
            await gen.__anext__()
        waiting = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await gen.aclose()
        assert seen.get("closed") is True

        # A body larger than one item leaves in slices (each a message of Serve's gRPC path, capped at 4 MiB).
        parts = [p async for p in run_asgi(app, ForwardedRequest("GET", "/big"))][1:]
        assert len(parts) > 1 and max(map(len, parts)) <= MAX_ITEM_BYTES
        assert json.loads(b"".join(parts))["text"] == "x" * (3 * MAX_ITEM_BYTES)

    asyncio.run(main())


def test_the_clients_request_id_comes_back_unless_serves_proxy_adds_it_itself() -> None:
    pytest.importorskip("ray", reason="deployments.py is the [ray] extra's")
    from starlette.responses import Response

    from flashvlm.server.ray_serve.asgi_bridge import ForwardedRequest, ResponseStart
    from flashvlm.server.ray_serve.deployments import _response

    forwarded = ForwardedRequest("POST", "/v1/chat/completions", headers=((b"x-request-id", b"abc"),))
    start = ResponseStart(200, [(b"x-request-id", b"abc"), (b"x-flashvlm-replica", b"r1")])
    front = _response(Response(b"{}"), start, forwarded, behind_serve_proxy=False)
    assert (b"x-request-id", b"abc") in front.raw_headers
    proxied = _response(Response(b"{}"), start, forwarded, behind_serve_proxy=True)
    assert all(k != b"x-request-id" for k, _ in proxied.raw_headers)
    assert (b"x-flashvlm-replica", b"r1") in proxied.raw_headers


async def _take_all(gen: AsyncIterator[Any]) -> list[Any]:
    return [p async for p in gen]


def test_merged_metrics_carry_the_replica_label() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from flashvlm.server.metrics import EngineMetrics
    from flashvlm.server.ray_serve.metrics_merge import merge_by_replica

    a, b = EngineMetrics("m", tiers=["default"]), EngineMetrics("m", tiers=["default"])
    a.update_engine_stats({"encoder_cache_hits": 5})
    b.update_engine_stats({"encoder_cache_hits": 2})
    page = merge_by_replica({"r1": a.render()[0].decode(), "r2": b.render()[0].decode()}).decode()
    hits = {s.labels["replica"]: s.value for f in text_string_to_metric_families(page)
            for s in f.samples if s.name == "flashvlm:encoder_cache_hits_total"}
    assert hits == {"r1": 5.0, "r2": 2.0}
    assert page.count("# TYPE flashvlm:encoder_cache_hits_total counter") == 1
