"""`flashvlm serve --ray`: join (or start) a Ray cluster, run the application on Serve's HTTP proxy at --host and
--port, and serve until SIGINT or SIGTERM; then delete the application (each replica gets --shutdown-timeout to
finish its requests) and leave the cluster (a local one started here stops with it)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

import ray
from ray import serve

from flashvlm.server.ray_serve.deployments import build_application
from flashvlm.server.ray_serve.options import RayServeOptions

APP_NAME = "flashvlm"


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def run_on_ray(args: argparse.Namespace) -> int:
    options = RayServeOptions.from_args(args).validate()
    ray.init(address=options.ray_address)
    # After ray.init, which installs its own SIGTERM handler: a SIGTERM stops the service as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    deployed = False
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        deployed = True
        serve.run(build_application(args), name=APP_NAME, route_prefix="/")
        count = (f"{options.min_replicas}..{options.max_replicas} replicas (autoscaling)" if options.autoscaling
                 else f"{options.num_replicas} replica(s)")
        print(f"flashvlm serving on Ray Serve at http://{args.host}:{args.port}/v1 with {count}", file=sys.stderr)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("flashvlm: stopping the Ray Serve application", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if deployed:
            serve.delete(APP_NAME)
        ray.shutdown()
    return 0
