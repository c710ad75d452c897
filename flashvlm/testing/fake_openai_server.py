"""A tiny OpenAI-compatible server for tests of clients (the bench load generator, the CLI).

It speaks just enough of the protocol: POST /v1/chat/completions and /v1/completions (streaming SSE or one JSON
body), GET /v1/models. Every request yields `tokens_per_request` copies of `token_text` (capped by max_tokens).
It records what it received so tests can assert on the wire format, and how many requests it held at once.

    with FakeOpenAIServer(tokens_per_request=4) as server:
        httpx.post(server.base_url + "/v1/chat/completions", json={...})
        server.received[0]["messages"]
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from dataclasses import KW_ONLY, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(eq=False)
class FakeOpenAIServer:
    """OpenAI-style streaming server on 127.0.0.1 (free port), run in a background thread while in a `with` block.

    Args:
        tokens_per_request: tokens generated when max_tokens does not cap them.
        token_text: the text of every generated token (one content chunk each).
        fail_every: every k-th request (1-based, in arrival order) gets HTTP 500 with an OpenAI error body.
        malformed_every: every k-th request gets a stream with a line that is not valid SSE JSON after its first
            content chunk, to exercise client error paths.
        first_token_delay_s / token_delay_s: sleeps before the first token and between tokens, so timing and
            concurrency are observable.
        image_tokens: prompt tokens charged per image in the usage report.
    """

    tokens_per_request: int = 8
    token_text: str = "tok"
    fail_every: int | None = None
    _: KW_ONLY
    malformed_every: int | None = None
    first_token_delay_s: float = 0.0
    token_delay_s: float = 0.0
    image_tokens: int = 16
    model: str = "fake-model"

    received: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)
    """Parsed JSON bodies of completion requests, in arrival order."""
    arrival_times: list[float] = field(default_factory=list, init=False, repr=False)
    """time.time() at which each body in `received` was read."""
    images_per_request: list[int] = field(default_factory=list, init=False, repr=False)
    tier_headers: list[str | None] = field(default_factory=list, init=False, repr=False)
    """The x-sla-tier header of each body in `received`."""
    in_flight: int = field(default=0, init=False, repr=False)
    max_in_flight: int = field(default=0, init=False, repr=False)

    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _httpd: _Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("server is not running; use it as a context manager")
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeOpenAIServer:
        self._httpd = _Server(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-openai-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._httpd is None:
            return
        httpd, self._httpd = self._httpd, None
        httpd.shutdown()
        # A client may still hold keep-alive connections; their handler threads would block in readline forever,
        # and server_close() joins them, so cut the sockets first.
        httpd.close_connections()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # Called from handler threads.

    def _admit(self, body: dict[str, Any], num_images: int, tier: str | None = None) -> int:
        with self._lock:
            self.received.append(body)
            self.tier_headers.append(tier)
            self.arrival_times.append(time.time())
            self.images_per_request.append(num_images)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return len(self.received)

    def _release(self) -> None:
        with self._lock:
            self.in_flight -= 1


class _Server(ThreadingHTTPServer):
    # Non-daemon handler threads so server_close() joins them: the fixture must not leak threads into other tests.
    daemon_threads = False
    block_on_close = True
    request_queue_size = 256  # the default of 5 resets connections when a load test opens many at once

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], owner: FakeOpenAIServer):
        super().__init__(address, handler)
        self.owner = owner
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):  # already closed by the client
                conn.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked streaming, like real servers
    disable_nagle_algorithm = True  # small SSE writes must not wait for delayed ACKs (would add ~40 ms gaps)
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/v1/models":
            self._send_json(404, _error("not found", "NotFoundError", 404))
            return
        owner = self.server.owner
        self._send_json(200, {"object": "list", "data": [
            {"id": owner.model, "object": "model", "created": 0, "owned_by": "flashvlm-tests"}]})

    def do_POST(self) -> None:
        # Read the body before any reply: left unread it would be parsed as the next request on this connection.
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        path = self.path.rstrip("/")
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._send_json(404, _error("not found", "NotFoundError", 404))
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body is not an object")
        except ValueError as e:
            self._send_json(400, _error(f"invalid JSON body: {e}", "BadRequestError", 400))
            return
        chat = path == "/v1/chat/completions"
        owner = self.server.owner
        index = owner._admit(body, _count_images(body) if chat else 0, self.headers.get("x-sla-tier"))
        released = False

        def release() -> None:
            # Called before the last byte goes out: once a client has seen the end of a response it may send the
            # next one, and that one must not find this one still counted as in flight.
            nonlocal released
            if not released:
                released = True
                owner._release()

        try:
            if owner.fail_every and index % owner.fail_every == 0:
                release()
                self._send_json(500, _error(f"injected failure for request {index}", "InternalServerError", 500))
                return
            self._complete(body, chat, index, release)
        except OSError:
            self.close_connection = True  # the client went away (or we are shutting down); nothing to answer
        finally:
            release()

    def _complete(self, body: dict[str, Any], chat: bool, index: int, release: Any) -> None:
        owner = self.server.owner
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        n = owner.tokens_per_request if max_tokens is None else max(0, min(int(max_tokens), owner.tokens_per_request))
        prompt_tokens = _count_prompt_tokens(body, chat, owner.image_tokens)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n}
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        obj = "chat.completion" if chat else "text_completion"
        finish = "length" if max_tokens is not None and n == int(max_tokens) else "stop"
        base = {"id": rid, "object": obj + (".chunk" if chat else ""), "created": int(time.time()),
                "model": body.get("model", owner.model)}

        if not body.get("stream"):
            if owner.first_token_delay_s or owner.token_delay_s:
                time.sleep(owner.first_token_delay_s + max(0, n - 1) * owner.token_delay_s)
            text = owner.token_text * n
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                      if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
            release()
            self._send_json(200, {"id": rid, "object": obj, "created": base["created"], "model": base["model"],
                                  "choices": [choice], "usage": usage})
            return

        def chunk(delta_or_text: Any, finish_reason: str | None = None) -> dict[str, Any]:
            choice = ({"index": 0, "delta": delta_or_text, "logprobs": None, "finish_reason": finish_reason}
                      if chat else {"index": 0, "text": delta_or_text, "logprobs": None,
                                    "finish_reason": finish_reason})
            return {**base, "choices": [choice]}

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if chat:
            self._sse(chunk({"role": "assistant", "content": ""}))
        for i in range(n):
            time.sleep(owner.first_token_delay_s if i == 0 else owner.token_delay_s)
            self._sse(chunk({"content": owner.token_text} if chat else owner.token_text))
            if i == 0 and owner.malformed_every and index % owner.malformed_every == 0:
                self._write_chunk(b"data: {this is not json\n\n")
        self._sse(chunk({} if chat else "", finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            self._sse({**base, "choices": [], "usage": usage})
        release()
        self._write_chunk(b"data: [DONE]\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _sse(self, payload: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        # One HTTP chunk per SSE event so each event reaches the client as soon as it is produced.
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _error(message: str, kind: str, code: int) -> dict[str, Any]:
    return {"object": "error", "message": message, "type": kind, "param": None, "code": code,
            "error": {"message": message, "type": kind, "param": None, "code": code}}


def _content_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts.extend(p for p in content if isinstance(p, dict))
        elif isinstance(content, str):
            parts.append({"type": "text", "text": content})
    return parts


def _count_images(body: dict[str, Any]) -> int:
    return sum(1 for p in _content_parts(body) if p.get("type") == "image_url")


def _count_prompt_tokens(body: dict[str, Any], chat: bool, image_tokens: int) -> int:
    if not chat:
        prompt = body.get("prompt", "")
        return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
    words = sum(len(str(p.get("text", "")).split()) for p in _content_parts(body) if p.get("type") == "text")
    return words + image_tokens * _count_images(body)
