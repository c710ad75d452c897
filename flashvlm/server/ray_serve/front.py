"""The HTTP front of `flashvlm serve --ray`: the ingress's logic (deployments.py's `Ingress`: body bounds, routing
keys, resending on a lost replica, the merged /metrics) run in the launching process under `flashvlm serve`'s own
uvicorn server, over a handle to the engine deployment.

Why not Serve's HTTP proxy in front of an ingress deployment: that puts two more Ray hops on every request (proxy
to ingress, and each streamed chunk back from ingress to proxy); on one H200 they added 12 ms to a 45 ms time to
first token. Here a request crosses one Ray hop, the call to its engine replica. `build_application` keeps the
all-Serve layout for users who compose their own Serve applications."""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from flashvlm.server.app import error_response
from flashvlm.server.ray_serve.deployments import Ingress, IngressSettings

logger = logging.getLogger("flashvlm.server.ray")


class Front:
    """An ASGI app: every HTTP request through one `Ingress` over the engine deployment's handle (`connect`)."""

    def __init__(self, settings: IngressSettings) -> None:
        self._settings = settings
        self.ingress: Ingress | None = None

    def connect(self, engine: DeploymentHandle) -> None:
        self.ingress = Ingress(engine, self._settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        assert self.ingress is not None, "the launcher connects the front before it serves"
        try:
            response = await self.ingress(Request(scope, receive))
        except Exception as e:  # the ingress's own fault, not the request's: an OpenAI-style 500
            logger.exception("the ingress failed on %s %s", scope.get("method"), scope.get("path"))
            response = error_response(500, f"internal error in the ingress ({type(e).__name__})", "server_error")
        await response(scope, receive, send)


async def _lifespan(receive: Receive, send: Send) -> None:
    """Nothing to set up or tear down here (the launcher owns the deployment): acknowledge both."""
    while True:
        message: Any = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
