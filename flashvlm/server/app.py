"""The OpenAI-compatible HTTP API (FastAPI): routes, error bodies, request ids, optional API key.

Every error is answered as `{"error": {"message", "type", "param", "code"}}`; bad input is always a 4xx (FastAPI's
422 for a body that does not validate becomes OpenAI's 400), and only a fault of the server itself is a 5xx.
"""

from __future__ import annotations

import logging
import secrets
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashvlm import __version__
from flashvlm.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from flashvlm.request import InvalidRequestError
from flashvlm.server.admission import QueueFullError
from flashvlm.server.body import BodyBudget, BodyReader, BodyRefused, replaying
from flashvlm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
)
from flashvlm.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ModelList,
)
from flashvlm.server.serving import OpenAIServing, ServerSettings

logger = logging.getLogger("flashvlm.server")

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text} for code, text in (
        (400, "invalid request (malformed JSON, bad fields, bad images, prompt too long, ...)"),
        (401, "missing or wrong API key (--api-key)"),
        (403, "media source not allowed (local file outside --allowed-local-media-path)"),
        (404, "unknown model"),
        (408, "the request body stalled (--body-read-timeout)"),
        (413, "request body too large"),
        (429, "too many requests waiting; retry after the Retry-After header's seconds"),
        (500, "the engine failed while running the request"),
        (503, "the engine is not running, or request bodies in flight are at --max-body-bytes-in-flight"),
    )}
_STREAM_DOC = {"text/event-stream": {"schema": {"type": "string", "description": "data: <chunk JSON> events, "
                                                "then data: [DONE]"}}}


def error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def log_rejection(scope: Scope, status: int, code: str | None, message: str) -> None:
    """One line per refused request, in a fixed shape for log searches:
    `request <id> rejected: <status> <code> (<METHOD> <path>): <message>` (the message on one line, cut at 500
    characters). 4xx at INFO (the client's fault, logged like accepted requests), 5xx at WARNING."""
    request_id = scope.get("state", {}).get("request_id", "-")
    reason = message.replace("\r", "\\r").replace("\n", "\\n")[:500]
    logger.log(logging.WARNING if status >= 500 else logging.INFO, "request %s rejected: %d %s (%s %s): %s",
               request_id, status, code or "-", scope.get("method", "-"), scope.get("path", "-"), reason)


def _refuse(request: Request, status: int, message: str, type: str = "invalid_request_error",
            param: str | None = None, code: str | None = None,
            headers: dict[str, str] | None = None) -> JSONResponse:
    log_rejection(request.scope, status, code, message)
    return error_response(status, message, type, param, code, headers)


def build_app(engine: AsyncEngine, settings: ServerSettings, metrics: Any = None, tracer: Any = None) -> FastAPI:
    """The ASGI app over a running AsyncEngine. `metrics`: an EngineMetrics (serves /metrics); `tracer`: a Tracer."""
    # /openapi.json is always served; the HTML pages only with --enable-docs (they are blank without internet).
    app = FastAPI(title="flashvlm OpenAI-compatible API", version=__version__,
                  description="Chat and text completions for vision-language models; see docs/server.md.",
                  docs_url="/docs" if settings.enable_docs else None,
                  redoc_url="/redoc" if settings.enable_docs else None)
    serving = OpenAIServing(engine, settings, metrics, tracer)
    app.state.serving = serving
    app.state.engine = engine
    _install_error_handlers(app)
    max_body = _max_body_bytes(settings)
    if settings.body_read_timeout_s <= 0:
        raise ValueError(f"--body-read-timeout must be positive, got {settings.body_read_timeout_s}")
    if settings.max_body_bytes_in_flight < max_body:
        raise ValueError(f"--max-body-bytes-in-flight {settings.max_body_bytes_in_flight} is below the largest "
                         f"body one request may send ({max_body} bytes: every allowed image base64-encoded plus "
                         f"16 MiB); raise it or lower --max-image-bytes / --limit-mm-per-prompt")
    app.state.body_budget = BodyBudget(settings.max_body_bytes_in_flight)
    app.add_middleware(_RequestIdAndLimits, api_key=settings.api_key, max_body_bytes=max_body,
                       body_budget=app.state.body_budget, body_read_timeout_s=settings.body_read_timeout_s)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": _STREAM_DOC, "model": ChatCompletionChunk}, **_ERRORS})
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Chat with text and images (`image_url` parts); `stream: true` answers with server-sent events."""
        return await serving.chat(request, raw_request)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={200: {"content": _STREAM_DOC}, **_ERRORS})
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        """Text completion of one prompt (text or token ids)."""
        return await serving.completion(request, raw_request)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict[str, Any]:
        return serving.models()

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> Response:
        if not engine.is_alive:
            return error_response(503, "the engine is not running", "service_unavailable", code="engine_dead")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        if metrics is None:
            return error_response(404, "metrics are not enabled on this server", code="metrics_disabled")
        metrics.update_engine_stats(engine.stats())
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


def _max_body_bytes(settings: ServerSettings) -> int:
    # Every allowed image, or one largest video, as base64 (4/3 of its bytes) plus room for the text of a long
    # conversation.
    m = settings.media
    return max(max(1, m.limit_images) * m.max_image_bytes, m.max_video_bytes) * 4 // 3 + 16 * 1024 * 1024


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _refuse(request, e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, e: InvalidRequestError) -> JSONResponse:
        return _refuse(request, 400, str(e), code="invalid_request")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param, code = _validation_problem(e)
        return _refuse(request, 400, message, param=param, code=code)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, e: QueueFullError) -> JSONResponse:
        return _refuse(request, 429, str(e), "rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(e.retry_after_s)})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return _refuse(request, 503, str(e), "service_unavailable", code="engine_dead")

    @app.exception_handler(EngineStepError)
    async def engine_step(request: Request, e: EngineStepError) -> JSONResponse:
        return _refuse(request, 500, str(e), "server_error", code="engine_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _refuse(request, e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                       else "server_error", headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, f"internal server error: {type(e).__name__}", "server_error")


def _validation_problem(e: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of FastAPI's 422, which is answered as OpenAI's 400."""
    errors = e.errors()
    if not errors:
        return "invalid request", None, "invalid_request"
    if any(err.get("type") == "json_invalid" for err in errors):
        err = next(err for err in errors if err.get("type") == "json_invalid")
        return f"the body is not valid JSON: {err.get('ctx', {}).get('error', err['msg'])}", None, "invalid_json"
    # A union field reports one error per alternative; the deepest one names the actual problem.
    first = max(errors, key=lambda err: len(err.get("loc", ())))
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_union_branch(x)]
    where = ".".join(loc)
    message = f"{where}: {first['msg']}" if where else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return message, loc[0] if loc else None, "invalid_request"


def _is_union_branch(part: object) -> bool:
    # pydantic names the alternative it tried in the location: 'str', 'list[...]', 'function-after[...]'.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none", "list",
                                                              "dict"))


class _RequestIdAndLimits:
    """Echo (or assign) `x-request-id`, check the API key, read the body within its bounds (flashvlm/server/body.py)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_budget: BodyBudget,
                 body_read_timeout_s: float) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_budget = body_budget
        self.body_read_timeout_s = body_read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        state = scope.setdefault("state", {})
        state["request_id"] = headers.get("x-request-id") or uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("x-request-id", str(state["request_id"]))
            await send(message)

        async def refuse(status: int, message: str, type: str, code: str, close: bool = False) -> None:
            # A refused body is left unread; closing the connection drops whatever of it is still coming.
            log_rejection(scope, status, code, message)
            extra = {"Connection": "close"} if close else {}
            if status == 503:
                extra["Retry-After"] = "1"
            await error_response(status, message, type, code=code, headers=extra)(scope, receive, send_with_id)

        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            # Answered before a byte of the body is read.
            await refuse(413, f"the body is {length} bytes; the limit is {self.max_body_bytes}",
                         "invalid_request_error", "request_too_large", close=True)
            return
        if self.api_key is not None and scope["path"].startswith("/v1/"):
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await refuse(401, "missing or invalid API key", "authentication_error", "invalid_api_key")
                return
        reader = BodyReader(self.body_budget, self.max_body_bytes, self.body_read_timeout_s)
        try:
            try:
                body = await reader.read(receive, int(length) if length.isdigit() else None)
            except BodyRefused as e:
                reader.release()
                await refuse(e.status, str(e), "service_unavailable" if e.status == 503 else
                             "invalid_request_error", e.code, close=True)
                return
            if body is None:
                return  # the client left before its body arrived: nobody to answer
            await self.app(scope, replaying(body, receive), send_with_id)
        finally:
            reader.release()
