"""`flashvlm serve --ray`: join (or start) a Ray cluster, deploy the engine replicas on Serve, serve HTTP at --host
and --port from this process (front.py: the ingress under `flashvlm serve`'s own uvicorn server, no Serve HTTP
proxy) until SIGINT or SIGTERM; then drain the front (--shutdown-timeout), delete the application (each replica
gets --shutdown-timeout to finish its requests) and leave the cluster (a local one started here stops with it).

Through Ray Client (`--ray-address ray://...`) this process cannot hold a streaming handle, so there the ingress
runs as a Serve deployment behind Serve's HTTP proxy on the cluster (build_application's layout)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

import ray
from ray import serve

from flashvlm.server.http_server import GracefulServer, build_server
from flashvlm.server.ray_serve.deployments import build_application, engine_deployment, ingress_settings
from flashvlm.server.ray_serve.front import Front
from flashvlm.server.ray_serve.options import RayServeOptions

APP_NAME = "flashvlm"


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def run_on_ray(args: argparse.Namespace) -> int:
    options = RayServeOptions.from_args(args).validate()
    server, front, listening = None, None, None
    if not options.through_ray_client:
        # The front's flags are checked and its port taken before any replica loads, which can take minutes.
        server, front = build_front(args)
        listening = server.config.bind_socket()
    ray.init(address=options.ray_address)
    # After ray.init, which installs its own SIGTERM handler: until the front runs (it handles both signals
    # itself), a SIGTERM stops the service as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    deployed = False
    try:
        if front is None:
            serve.start(http_options={"host": args.host, "port": args.port})
            deployed = True
            serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        else:
            serve.start(proxy_location="Disabled")
            deployed = True
            deploy(args, options, front)
        count = (f"{options.min_replicas}..{options.max_replicas} replicas (autoscaling)" if options.autoscaling
                 else f"{options.num_replicas} replica(s)")
        print(f"flashvlm serving on Ray Serve at http://{args.host}:{args.port}/v1 with {count}", file=sys.stderr)
        if server is None:
            while True:
                time.sleep(3600)
        server.run(sockets=[listening])
    except KeyboardInterrupt:
        pass
    finally:
        print("flashvlm: stopping the Ray Serve application", file=sys.stderr)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if listening is not None:
            listening.close()
        if deployed:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0


def build_front(args: argparse.Namespace) -> tuple[GracefulServer, Front]:
    """The front's server (its flags checked) and the front, not yet connected to the replicas (`deploy`)."""
    front = Front(ingress_settings(args, RayServeOptions.from_args(args)))
    server = build_server(front, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                          shutdown_timeout_s=args.shutdown_timeout, header_read_timeout_s=args.header_read_timeout)
    return server, front


def deploy(args: argparse.Namespace, options: RayServeOptions, front: Front) -> None:
    """Deploy the engine replicas (application APP_NAME, no HTTP route of Serve's) and connect the front to them."""
    front.connect(serve.run(engine_deployment(args, options).bind(args), name=APP_NAME, route_prefix=None))
