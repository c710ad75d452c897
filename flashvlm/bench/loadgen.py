"""Client-side load generator for the `serve` scenario: replays BenchRequests against any OpenAI-compatible endpoint.

Timing follows `vllm bench serve` so our figures compare with theirs:
  - TTFT: first chunk carrying output text minus the moment the request was sent;
  - ITL: gaps between consecutive output-carrying chunks after the first (one entry per chunk, not per token);
  - E2E: end of the stream (`data: [DONE]`) minus the send moment;
  - output tokens: the server's `usage.completion_tokens` when it reports usage, else the number of output chunks.
TPOT is derived by RequestRecord from these. A request that fails (transport error, non-200, broken stream, no
output) becomes a record with success=False and the reason, never an exception out of run_load.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import mimetypes
import os
import time
from collections.abc import Sequence
from typing import Any, Literal

import httpx
import numpy as np
from tqdm.auto import tqdm

from flashvlm.bench.records import BenchRequest, RequestRecord

Endpoint = Literal["chat", "completions"]

_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_SSE_IGNORED_FIELDS = ("event", "id", "retry")


class RequestFailed(Exception):
    """One request went wrong in a way the server or the stream told us about; its message goes in the record."""


def endpoint_url(base_url: str, endpoint: Endpoint) -> str:
    """Full URL for an endpoint; base_url may or may not already end in /v1."""
    if endpoint not in _PATHS:
        raise ValueError(f"endpoint must be one of {sorted(_PATHS)}, got {endpoint!r}")
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + _PATHS[endpoint]


class ImageEncoder:
    """Turns images into `image_url` URLs (data URIs), encoding each distinct image once per run.

    Workloads reuse the same array or file across requests (repeated-image ratios), and PNG encoding of a large
    image costs tens of milliseconds: that must happen once, before the clock starts, not per send.
    """

    def __init__(self) -> None:
        # Keyed by id() for arrays; the object is kept alongside so its id cannot be recycled while cached.
        self._cache: dict[tuple[str, Any], tuple[Any, str]] = {}

    def url(self, image: Any) -> str:
        if isinstance(image, (str, os.PathLike)):
            path = os.fspath(image)
            if path.startswith(("http://", "https://", "data:")):
                return path  # already a URL the server resolves itself
            key: tuple[str, Any] = ("path", path)
        elif isinstance(image, np.ndarray) or hasattr(image, "save"):  # numpy array or PIL image
            key = ("obj", id(image))
        else:
            raise TypeError(f"unsupported image type {type(image).__name__}; expected a numpy array or a file path")
        hit = self._cache.get(key)
        if hit is None:
            hit = (image, self._encode(image))
            self._cache[key] = hit
        return hit[1]

    @staticmethod
    def _encode(image: Any) -> str:
        if isinstance(image, (str, os.PathLike)):
            path = os.fspath(image)
            with open(path, "rb") as f:
                data = f.read()
            mime = mimetypes.guess_type(path)[0] or "image/png"
        else:
            from PIL import Image

            if isinstance(image, np.ndarray):
                if image.dtype != np.uint8:
                    raise TypeError(f"image arrays must be uint8, got {image.dtype}")
                image = Image.fromarray(image)
            buf = io.BytesIO()
            # Lossless either way; level 1 is several times faster than the default on noise-like synthetic images.
            image.save(buf, format="PNG", compress_level=1)
            data, mime = buf.getvalue(), "image/png"
        return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def build_body(req: BenchRequest, model: str, endpoint: Endpoint, encoder: ImageEncoder,
               extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON body of one streaming request; extra_body keys (ignore_eos, temperature, ...) override defaults."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": encoder.url(im)}}
                                         for im in req.images]
        content.append({"type": "text", "text": req.prompt})
        body["messages"] = [{"role": "user", "content": content}]
    else:
        if req.images:
            raise ValueError("the completions endpoint cannot carry images; use endpoint='chat'")
        body["prompt"] = req.prompt
    if extra_body:
        body.update(extra_body)
    return body


async def run_load(base_url: str, model: str, requests: Sequence[BenchRequest], *,
                   arrival_offsets: Sequence[float] | None = None, max_concurrency: int | None = None,
                   endpoint: Endpoint = "chat", timeout_s: float = 600.0, headers: dict[str, str] | None = None,
                   progress: bool = True, extra_body: dict[str, Any] | None = None,
                   request_headers: Sequence[dict[str, str] | None] | None = None,
                   ) -> tuple[list[RequestRecord], float]:
    """Send `requests` (streaming) and measure each; returns the records in request order and the duration.

    Args:
        arrival_offsets: seconds after the start at which each request arrives (e.g. Poisson); None sends all
            at once. A request that arrives while `max_concurrency` requests are in flight waits for a slot, as in
            vllm's client, so its TTFT does not include that wait.
        max_concurrency: cap on requests in flight; None for no cap.
        timeout_s: limit on one request from send to end of stream.
        request_headers: extra headers per request (e.g. each one's SLA tier), on top of `headers`.
    Returns:
        (records, duration) where duration runs from the first send to the last completion, in seconds.
    """
    if arrival_offsets is not None:
        if len(arrival_offsets) != len(requests):
            raise ValueError(f"{len(arrival_offsets)} arrival offsets for {len(requests)} requests")
        if any(off < 0 for off in arrival_offsets):
            raise ValueError("arrival offsets must be >= 0")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if request_headers is not None and len(request_headers) != len(requests):
        raise ValueError(f"{len(request_headers)} header sets for {len(requests)} requests")
    url = endpoint_url(base_url, endpoint)

    # Everything CPU-heavy (image encoding) happens before the clock starts; see ImageEncoder.
    encoder = ImageEncoder()
    bodies: list[dict[str, Any] | str] = []  # a str is the reason the request could not be built
    for req in requests:
        try:
            bodies.append(build_body(req, model, endpoint, encoder, extra_body))
        except (OSError, TypeError, ValueError) as e:
            bodies.append(f"could not build request: {type(e).__name__}: {e}")

    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    send_times: list[float] = []
    end_times: list[float] = []
    # No bar object at all when off: even a disabled tqdm starts its monitor thread.
    bar = tqdm(total=len(requests), desc="serve", unit="req") if progress else None
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits, headers=headers) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(i: int) -> RequestRecord:
            req, body = requests[i], bodies[i]
            extra = request_headers[i] if request_headers is not None else None
            try:
                if isinstance(body, str):
                    return RequestRecord(request_id=req.request_id, success=False, error=body,
                                         num_images=len(req.images))
                if arrival_offsets is not None:
                    target = t0 + arrival_offsets[i]
                    # Loop because a timer may fire a hair early; a request must never go out before its offset.
                    while (wait := target - loop.time()) > 0:
                        await asyncio.sleep(wait)
                if semaphore is None:
                    return await _send(client, url, req, body, endpoint, timeout_s, send_times, end_times, extra)
                async with semaphore:
                    return await _send(client, url, req, body, endpoint, timeout_s, send_times, end_times, extra)
            finally:
                if bar is not None:
                    bar.update(1)

        try:
            records = list(await asyncio.gather(*(one(i) for i in range(len(requests)))))
        finally:
            if bar is not None:
                bar.close()
    duration = max(end_times) - min(send_times) if send_times else 0.0
    return records, duration


def run_load_sync(base_url: str, model: str, requests: Sequence[BenchRequest], *,
                  arrival_offsets: Sequence[float] | None = None, max_concurrency: int | None = None,
                  endpoint: Endpoint = "chat", timeout_s: float = 600.0, headers: dict[str, str] | None = None,
                  progress: bool = True, extra_body: dict[str, Any] | None = None,
                  request_headers: Sequence[dict[str, str] | None] | None = None,
                  ) -> tuple[list[RequestRecord], float]:
    """run_load for callers without an event loop (the CLI, tests)."""
    return asyncio.run(run_load(base_url, model, requests, arrival_offsets=arrival_offsets,
                                max_concurrency=max_concurrency, endpoint=endpoint, timeout_s=timeout_s,
                                headers=headers, progress=progress, extra_body=extra_body,
                                request_headers=request_headers))


async def _send(client: httpx.AsyncClient, url: str, req: BenchRequest, body: dict[str, Any], endpoint: Endpoint,
                timeout_s: float, send_times: list[float], end_times: list[float],
                extra_headers: dict[str, str] | None = None) -> RequestRecord:
    rec = RequestRecord(request_id=req.request_id, num_images=len(req.images),
                        prompt_tokens=len(req.prompt_token_ids or ()))
    content = json.dumps(body).encode()  # serialized here, not up front: bodies share image strings, bytes would not
    rec.start_time = time.time()
    st = time.perf_counter()
    send_times.append(st)
    try:
        await asyncio.wait_for(_stream(client, url, content, endpoint == "chat", rec, st, extra_headers), timeout_s)
    except asyncio.TimeoutError:
        rec.success, rec.error = False, f"timed out after {timeout_s:g} s"
    except RequestFailed as e:
        rec.success, rec.error = False, str(e)
    except Exception as e:  # one bad request (of any kind) must not end the benchmark
        rec.success, rec.error = False, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    end_times.append(time.perf_counter())
    if not rec.success:
        rec.e2e = None  # a failed request has no end-to-end latency; partial ttft/itl stay for debugging
    return rec


async def _stream(client: httpx.AsyncClient, url: str, content: bytes, chat: bool, rec: RequestRecord,
                  st: float, extra_headers: dict[str, str] | None = None) -> None:
    """Post one request and read its SSE stream, filling rec's timings and token counts."""
    headers = {"Content-Type": "application/json", **(extra_headers or {})}
    async with client.stream("POST", url, content=content, headers=headers) as resp:
        if resp.status_code != 200:
            raise RequestFailed(f"HTTP {resp.status_code}: {_error_message(await resp.aread())}")
        ctype = resp.headers.get("content-type", "")
        if not ctype.startswith("text/event-stream"):
            raise RequestFailed(f"expected a text/event-stream response, got {ctype or 'no content type'!r}")
        usage: dict[str, Any] | None = None
        chunks = 0
        last = st
        done = False
        async for line in resp.aiter_lines():
            if done or not line or line.startswith(":"):
                continue  # blank separators, SSE comments (keep-alives) and anything after [DONE]
            name, _, value = line.partition(":")
            if name in _SSE_IGNORED_FIELDS:
                continue
            if name != "data":
                raise RequestFailed(f"malformed SSE line: {line[:200]!r}")
            value = value.removeprefix(" ")
            now = time.perf_counter()
            if value == "[DONE]":
                rec.e2e = now - st
                done = True
                continue
            try:
                data = json.loads(value)
            except ValueError:
                raise RequestFailed(f"malformed SSE data (not JSON): {value[:200]!r}") from None
            if not isinstance(data, dict):
                raise RequestFailed(f"malformed SSE data (not an object): {value[:200]!r}")
            if data.get("error") and not data.get("choices"):
                raise RequestFailed(f"error in stream: {_error_message(value.encode())}")
            if data.get("usage"):
                usage = data["usage"]
            if _chunk_text(data, chat):
                if chunks == 0:
                    rec.ttft = now - st
                else:
                    rec.itl.append(now - last)
                last = now
                chunks += 1
        rec.output_tokens = chunks
        if not done:
            raise RequestFailed("stream ended without data: [DONE]")
        if chunks == 0:
            raise RequestFailed("stream carried no output text")
        if usage:
            if isinstance(usage.get("completion_tokens"), int):
                rec.output_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                rec.prompt_tokens = usage["prompt_tokens"]
        rec.success = True


def _chunk_text(data: dict[str, Any], chat: bool) -> str:
    """Output text a chunk carries ('' for role, finish and usage chunks)."""
    choices = data.get("choices")
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning models stream thinking separately; it is generated output all the same.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _error_message(raw: bytes) -> str:
    """The message of an OpenAI-style error body, or the start of whatever the server sent."""
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:300].decode("utf-8", "replace") or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if data.get("message"):
            return str(data["message"])
    return json.dumps(data)[:300]
