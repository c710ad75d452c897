"""`flashvlm serve --ray`: join (or start) a Ray cluster, run the application on Serve's HTTP proxy at --host and
--port, and serve until SIGINT or SIGTERM; then delete the application (replicas get --shutdown-timeout to finish
their requests) and leave the cluster."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

import ray
from ray import serve

from flashvlm.server.ray_serve.deployments import build_application
from flashvlm.server.ray_serve.options import RayServeOptions

APP_NAME = "flashvlm"


def run_on_ray(args: argparse.Namespace) -> int:
    options = RayServeOptions.from_args(args).validate()
    ray.init(address=options.ray_address)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        count = (f"{options.min_replicas}..{options.max_replicas} replicas (autoscaling)" if options.autoscaling
                 else f"{options.num_replicas} replica(s)")
        print(f"flashvlm serving on Ray Serve at http://{args.host}:{args.port}/v1 with {count}", file=sys.stderr)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    return 0
