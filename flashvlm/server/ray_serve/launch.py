"""`flashvlm serve --ray`: join (or start) a Ray cluster, deploy the engine replicas on Serve, serve HTTP at --host
and --port from this process (front.py: the ingress under `flashvlm serve`'s own uvicorn server, no Serve HTTP
proxy) until SIGINT or SIGTERM; then drain the front (--shutdown-timeout), delete the application (each replica
gets --shutdown-timeout to finish its requests) and leave the cluster (a local one started here stops with it)."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

import ray
from ray import serve

from flashvlm.server.http_server import GracefulServer, build_server
from flashvlm.server.ray_serve.deployments import engine_deployment, ingress_settings
from flashvlm.server.ray_serve.front import Front
from flashvlm.server.ray_serve.options import RayServeOptions

APP_NAME = "flashvlm"


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def run_on_ray(args: argparse.Namespace) -> int:
    options = RayServeOptions.from_args(args).validate()
    ray.init(address=options.ray_address)
    # After ray.init, which installs its own SIGTERM handler: until the front runs (it handles both signals
    # itself), a SIGTERM stops the service as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    deployed = False
    try:
        serve.start(proxy_location="Disabled")
        deployed = True
        server = deploy(args, options)
        count = (f"{options.min_replicas}..{options.max_replicas} replicas (autoscaling)" if options.autoscaling
                 else f"{options.num_replicas} replica(s)")
        print(f"flashvlm serving on Ray Serve at http://{args.host}:{args.port}/v1 with {count}", file=sys.stderr)
        server.run()
        print("flashvlm: stopping the Ray Serve application", file=sys.stderr)
    except KeyboardInterrupt:
        print("flashvlm: stopping the Ray Serve application", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if deployed:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0


def deploy(args: argparse.Namespace, options: RayServeOptions) -> GracefulServer:
    """Deploy the engine replicas (application APP_NAME, no HTTP route of Serve's) and build the front over them;
    `.run()` serves until a stop signal (or `should_exit`)."""
    engine = serve.run(engine_deployment(args, options).bind(args), name=APP_NAME, route_prefix=None)
    return build_server(Front(engine, ingress_settings(args, options)), host=args.host, port=args.port,
                        log_level=args.uvicorn_log_level, shutdown_timeout_s=args.shutdown_timeout,
                        header_read_timeout_s=args.header_read_timeout)
