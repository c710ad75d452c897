"""The Ray Serve application: an `Ingress` deployment in front of N `EngineReplica`s.

Each replica runs `flashvlm serve`'s own app (server/cli.py's `build_serving`: the same routes, fields,
streaming, errors, SLA tiers, API key and metrics) over its own engine; the ingress only moves bytes. It reads a
request's body, derives its routing keys (keys.py), and forwards the request through a handle whose router
(router.py) picks the replica; the replica's response comes back as it is produced. So there is one code path for
the API, and routing sees the body, which Serve's HTTP proxy does not hand to a router.

A lost replica (its actor died): a request of which nothing reached the client yet is sent again to another
replica; a stream already under way ends with an error event (code `replica_lost`) and `data: [DONE]`; Serve's
controller starts a replacement. The health check is the engine's own (`is_alive`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import Response

from flashvlm.server.app import error_response
from flashvlm.server.body import BodyBudget, BodyReader, BodyRefused
from flashvlm.server.metrics import CONTENT_TYPE, PREFIX
from flashvlm.server.ray_serve.affinity import RouteTicket
from flashvlm.server.ray_serve.asgi_bridge import ForwardedRequest, ResponseStart, run_asgi
from flashvlm.server.ray_serve.keys import NO_KEYS, ROUTED_PATHS, routing_keys
from flashvlm.server.ray_serve.metrics_merge import merge_by_replica
from flashvlm.server.ray_serve.options import RayServeOptions
from flashvlm.server.ray_serve.router import CacheAffinityRouter
from flashvlm.server.sse import SSEResponse

logger = logging.getLogger("flashvlm.server.ray")

ENGINE_DEPLOYMENT = "FlashvlmEngine"
REPLICA_HEADER = b"x-flashvlm-replica"
"""Response header naming the replica that answered (its Serve replica id)."""
LOST = (RayActorError, ActorUnavailableError)
"""What a call to a replica raises when the replica is gone."""
MAX_ATTEMPTS = 3
"""Replicas one request is tried on before it is answered 503 replica_lost."""
METRICS_TIMEOUT_S = 5.0
GRPC_BODY_BYTES = 3 << 20
"""Bodies up to this size go over Serve's gRPC path, under its default 4 MiB message cap with room for the
headers; larger ones as Ray actor calls. (Response items stay under the cap: asgi_bridge.MAX_ITEM_BYTES.)"""


class EngineReplica:
    """One engine and `flashvlm serve`'s app over it, fed forwarded requests."""

    def __init__(self, serve_args: argparse.Namespace) -> None:
        from flashvlm.server.cli import build_serving

        self._app, self._engine, self._tracer = build_serving(serve_args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._batching_interval_s = RayServeOptions.from_args(serve_args).stream_batching_interval_ms / 1000

    async def handle(self, ticket: RouteTicket, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's response to `request`: its ResponseStart, then its body chunks (`ticket` is the router's)."""
        async for part in run_asgi(self._app, request, ((REPLICA_HEADER, self.replica_id.encode()),),
                                   self._batching_interval_s):
            yield part

    def check_health(self) -> None:
        if not self._engine.is_alive:
            raise RuntimeError("the engine is not running")

    def __del__(self) -> None:
        engine, tracer = getattr(self, "_engine", None), getattr(self, "_tracer", None)
        if engine is not None:
            engine.shutdown()
        if tracer is not None:
            tracer.shutdown()


@dataclass(frozen=True)
class IngressSettings:
    block_chars: int
    max_body_bytes_in_flight: int
    """Body bytes the ingress holds across all requests (--max-body-bytes-in-flight), as `flashvlm serve` does; also
    the most one body may have here (the replica's app then applies its own, smaller, per-request limit)."""
    body_read_timeout_s: float
    behind_serve_proxy: bool = False
    """The ingress is a Serve deployment behind Serve's HTTP proxy, which puts its own x-request-id on every
    response (build_application); the front answers clients itself."""


class Ingress:
    """HTTP in, forwarded to an engine replica chosen by the cache-aware router; /metrics from every replica."""

    def __init__(self, engine: DeploymentHandle, settings: IngressSettings) -> None:
        # Over each replica's gRPC server rather than as Ray actor calls: the body is not put in the object store,
        # and a streamed chunk skips the actor-task machinery (a few ms less per request on a 2-core host). gRPC
        # caps a message at RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH, so larger bodies take the actor path; both
        # handles share one router. A replica lost mid-call raises ActorUnavailableError on either.
        self._engine_by_value = engine.options(stream=True, _by_reference=False)
        self._engine = engine.options(stream=True)
        self._settings = settings
        self.registry = CollectorRegistry(auto_describe=True)
        self._decisions = Counter(PREFIX + "router_decisions", "Routed requests by the router's choice: prefix_hit, "
                                  "image_hit (sent where its prefix or images are cached), fallback (that replica "
                                  "was over the load bound or full), least_loaded (no known key).",
                                  ["decision", "replica"], registry=self.registry)
        self._resent = Counter(PREFIX + "router_resent_requests", "Requests sent again to another replica after "
                               "the one they were on was lost, before any of their response reached the client.",
                               registry=self.registry)
        self._bodies = BodyBudget(settings.max_body_bytes_in_flight)
        self._lost_streams = Counter(PREFIX + "router_lost_streams", "Streams cut by the loss of their replica "
                                     "(ended with a replica_lost error event).", registry=self.registry)

    async def __call__(self, request: Request) -> Response:
        # The body is read within the bounds `flashvlm serve` reads it with (server/body.py), and held until the
        # response starts: until then the request may be sent again to another replica.
        reader = BodyReader(self._bodies, self._settings.max_body_bytes_in_flight, self._settings.body_read_timeout_s)
        try:
            length = request.headers.get("content-length", "")
            try:
                body = await reader.read(request.receive, int(length) if length.isdigit() else None)
            except BodyRefused as e:
                return error_response(e.status, str(e), "service_unavailable" if e.status == 503 else
                                      "invalid_request_error", code=e.code,
                                      headers={"Connection": "close", **({"Retry-After": "1"} if e.status == 503
                                                                         else {})})
            if body is None:
                return Response(status_code=499)  # the client left before its body arrived: nobody reads this
            path = request.url.path
            forwarded = ForwardedRequest(request.method, path, request.scope.get("query_string", b""),
                                         tuple(request.scope["headers"]), body, request.scope.get("client"))
            if path == "/metrics" and request.method == "GET":
                return await self._metrics(forwarded)
            keys = routing_keys(path, body, self._settings.block_chars) if request.method == "POST" else NO_KEYS
            return await self._forward(forwarded, keys, count=path in ROUTED_PATHS)
        finally:
            reader.release()

    async def _forward(self, forwarded: ForwardedRequest, keys: Any, count: bool) -> Response:
        exclude: list[str] = []
        for attempt in range(MAX_ATTEMPTS):
            ticket = RouteTicket(keys=keys, exclude=tuple(exclude))
            engine = self._engine_by_value if len(forwarded.body) <= GRPC_BODY_BYTES else self._engine
            stream = engine.handle.remote(ticket, forwarded)
            try:
                start = await stream.__anext__()
                if not start.is_event_stream:  # a whole JSON body: read it all before the client sees any of it
                    body = b"".join([chunk async for chunk in stream])
                    if _engine_dead(start, body):  # the replica's engine stopped; Serve's health check will see it
                        raise ReplicaEngineDead(f"replica {ticket.replica}: its engine is not running")
            except (*LOST, ReplicaEngineDead) as e:
                stream.cancel()
                logger.warning("replica %s lost before answering (attempt %d): %s", ticket.replica, attempt + 1, e)
                if ticket.replica is not None:
                    exclude.append(ticket.replica)
                if attempt + 1 < MAX_ATTEMPTS:
                    self._resent.inc()
                continue
            except BaseException:
                stream.cancel()
                raise
            if count:
                self._decisions.labels(ticket.decision(), ticket.replica or "").inc()
            proxy = self._settings.behind_serve_proxy
            if not start.is_event_stream:
                return _response(Response(body), start, forwarded, proxy)
            return _response(SSEResponse(_RestOfStream(stream, ticket, self._lost_streams)), start, forwarded, proxy)
        return error_response(503, f"the request's replica was lost {MAX_ATTEMPTS} times", "service_unavailable",
                              code="replica_lost", headers={"Retry-After": "1"})

    async def _metrics(self, forwarded: ForwardedRequest) -> Response:
        """Every replica's metrics, labelled by replica, then the router's."""
        pages: dict[str, str] = {}
        probe = RouteTicket()
        await self._collect_page(probe, forwarded, pages)
        for replica in probe.known_replicas:
            if replica not in pages:
                await self._collect_page(RouteTicket(pin=replica), forwarded, pages)
        body = merge_by_replica(pages) + generate_latest(self.registry)
        return Response(body, media_type=CONTENT_TYPE)

    async def _collect_page(self, ticket: RouteTicket, forwarded: ForwardedRequest, pages: dict[str, str]) -> None:
        stream = self._engine.handle.remote(ticket, forwarded)

        async def read() -> bytes:
            start = await stream.__anext__()
            body = b"".join([chunk async for chunk in stream])
            return body if start.status == 200 else b""

        try:
            body = await asyncio.wait_for(read(), METRICS_TIMEOUT_S)
        except (asyncio.TimeoutError, *LOST):
            stream.cancel()
            return  # a replica starting or going away has no page this time
        if ticket.replica is not None and body:
            pages[ticket.replica] = body.decode()


class ReplicaEngineDead(Exception):
    """A replica answered 503 engine_dead: it is up, its engine is not; the request goes to another replica."""


def _engine_dead(start: ResponseStart, body: bytes) -> bool:
    if start.status != 503:
        return False
    try:
        return json.loads(body)["error"]["code"] == "engine_dead"
    except (ValueError, KeyError, TypeError):
        return False


class _RestOfStream:
    """The rest of a replica's event stream, for SSEResponse (which closes it however the response ends: finished,
    the client gone, or never started). Closing it cancels the call, which aborts the request on the replica. A
    lost replica becomes a last `replica_lost` error event, then `data: [DONE]`."""

    def __init__(self, stream: Any, ticket: RouteTicket, lost: Counter) -> None:
        self._stream = stream
        self._ticket = ticket
        self._lost = lost
        self._ended = False

    def __aiter__(self) -> _RestOfStream:
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        try:
            return await self._stream.__anext__()
        except StopAsyncIteration:
            self._ended = True
            raise
        except LOST as e:
            self._ended = True
            self._lost.inc()
            logger.warning("replica %s lost mid-stream: %s", self._ticket.replica, e)
            error = {"message": f"the replica serving this stream was lost ({type(e).__name__}); the output above "
                                "is incomplete", "type": "server_error", "param": None, "code": "replica_lost"}
            return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()

    async def aclose(self) -> None:
        self._ended = True
        self._stream.cancel()  # a no-op once the stream ended


def _response(response: Response, start: ResponseStart, forwarded: ForwardedRequest,
              behind_serve_proxy: bool) -> Response:
    """`response` with the replica's headers (content type and length, x-request-id, Retry-After, the replica's
    name); behind Serve's proxy, less an x-request-id equal to the one the proxy put on the request: the proxy adds
    that one itself."""
    proxy_id = next((v for k, v in forwarded.headers if k.lower() == b"x-request-id"), None) \
        if behind_serve_proxy else None
    response.status_code = start.status
    response.raw_headers = [(k, v) for k, v in start.headers
                            if proxy_id is None or not (k.lower() == b"x-request-id" and v == proxy_id)]
    return response


def build_application(serve_args: argparse.Namespace | list[str]) -> Any:
    """A Serve application of `flashvlm serve --ray`'s deployments with these flags (a parsed namespace, or the
    argument list `flashvlm serve` takes, e.g. ["--model", "/ckpt", "--num-replicas", "2"]), for composing into
    your own Serve applications: the ingress as a deployment behind Serve's HTTP proxy. Run it with
    `serve.run(app)`. `flashvlm serve --ray` itself runs the ingress in its own HTTP server instead (front.py)."""
    if not isinstance(serve_args, argparse.Namespace):
        serve_args = parse_serve_args(serve_args)
    options = RayServeOptions.from_args(serve_args).validate()
    engine = engine_deployment(serve_args, options)
    most_replicas = options.max_replicas or options.num_replicas
    ingress = serve.deployment(Ingress, name="FlashvlmIngress", num_replicas=1,
                               ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=most_replicas * engine.max_ongoing_requests + 64)
    settings = replace(ingress_settings(serve_args, options), behind_serve_proxy=True)
    return ingress.bind(engine.bind(serve_args), settings)


def engine_deployment(serve_args: argparse.Namespace, options: RayServeOptions) -> Any:
    """The engine replicas' Serve deployment (bind it to `serve_args`), routed by the cache-aware router."""
    engine_options = options.deployment_options(serve_args.max_num_seqs, serve_args.max_waiting_requests,
                                                use_gpu=_wants_gpu(serve_args.device))
    router = RequestRouterConfig(request_router_class=CacheAffinityRouter,
                                 request_router_kwargs=options.router_kwargs())
    return serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT, request_router_config=router,
                            graceful_shutdown_timeout_s=max(1.0, serve_args.shutdown_timeout), **engine_options)


def ingress_settings(serve_args: argparse.Namespace, options: RayServeOptions) -> IngressSettings:
    return IngressSettings(block_chars=options.prefix_block_chars,
                           max_body_bytes_in_flight=serve_args.max_body_bytes_in_flight,
                           body_read_timeout_s=serve_args.body_read_timeout)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    from flashvlm.server.cli import build_parser

    parser = argparse.ArgumentParser(prog="flashvlm")
    build_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def _wants_gpu(device: str) -> bool:
    """A replica asks Ray for a GPU when the engine will run on one: --device cuda, or auto on a cluster that has
    GPUs (or, before Ray is up, a machine that sees CUDA)."""
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    import ray

    if ray.is_initialized():
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()
