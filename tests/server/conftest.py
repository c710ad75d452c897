"""A real uvicorn server on 127.0.0.1 (free port, background thread) over a tiny Qwen2-VL checkpoint, shared by
the server tests. `start_server` builds more (the overload test needs its own limits)."""

from __future__ import annotations

import base64
import io
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from PIL import Image

from flashvlm import LLM
from flashvlm.engine.async_engine import AsyncEngine
from flashvlm.server.admission import Admission
from flashvlm.server.app import build_app
from flashvlm.server.media import MediaPolicy
from flashvlm.server.serving import ServerSettings
from flashvlm.server.tiers import load_tiers
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

MODEL = "tiny-vlm"
MAX_MODEL_LEN = 256
LIMIT_IMAGES = 2
MAX_IMAGE_BYTES = 64 * 1024
MAX_VIDEO_BYTES = 64 * 1024
"""Below LIMIT_IMAGES images' bytes, so the body limit stays the images' (tests/server/test_read_limits.py)."""
MAX_IMAGE_PIXELS = 512 * 512


@dataclass
class LiveServer:
    base_url: str
    engine: AsyncEngine
    metrics: Any
    media_dir: Path
    server: uvicorn.Server
    thread: threading.Thread
    tracer: Any = None
    app: Any = None

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.engine.shutdown()

    def wait_idle(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Poll the engine's stats until nothing runs or waits and every KV block is free (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.engine.stats()
            idle = (stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["num_queued"] == 0
                    and stats["num_free_blocks"] == stats["num_usable_blocks"])
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.01)


REJECTION_LINE = re.compile(r"^request (?P<id>\S+) rejected: (?P<status>\d{3}) (?P<code>\S+) \((?P<method>[A-Z]+) "
                            r"(?P<path>\S+)\): (?P<reason>.+)$")
"""The one log line of a refused request (flashvlm.server.app.log_rejection)."""


def rejection_lines(caplog: pytest.LogCaptureFixture, request_id: str) -> list[tuple[int, dict[str, str]]]:
    """(level, fields) of each rejection line logged for `request_id`."""
    out = []
    for rec in caplog.records:
        if rec.name == "flashvlm.server" and (m := REJECTION_LINE.match(rec.getMessage())) and m["id"] == request_id:
            out.append((rec.levelno, m.groupdict()))
    return out


@pytest.fixture
def rejections(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger="flashvlm.server")
    yield caplog


def png_bytes(w: int = 56, h: int = 56, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(text: str, *uris: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": u}} for u in uris]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def start_server(llm: LLM, media_dir: Path, *, max_waiting_requests: int = 256, with_metrics: bool = True,
                 tracer: Any = None, header_read_timeout_s: float = 10.0, image_threads: int | None = None,
                 image_decodes_per_request: int | None = None, media_kw: dict[str, Any] | None = None,
                 **settings_kw: Any) -> LiveServer:
    """`settings_kw`: more ServerSettings fields (body_read_timeout_s, max_body_bytes_in_flight); `media_kw`: more
    MediaPolicy fields (max_request_pixels ...)."""
    from flashvlm.server.http_server import build_server
    from flashvlm.server.metrics import EngineMetrics

    tiers = load_tiers(None)
    engine = AsyncEngine(llm.engine, admission=Admission(max_waiting_requests), image_threads=image_threads,
                         image_decodes_per_request=image_decodes_per_request)
    metrics = EngineMetrics(MODEL, tiers=tiers.names, max_model_len=engine.max_model_len) if with_metrics else None
    policy = MediaPolicy(**{"max_image_bytes": MAX_IMAGE_BYTES, "max_image_pixels": MAX_IMAGE_PIXELS,
                            "limit_images": LIMIT_IMAGES, "allowed_local_media_path": media_dir,
                            "max_video_bytes": MAX_VIDEO_BYTES, **(media_kw or {})})
    settings = ServerSettings(served_model_names=[MODEL], media=policy, tiers=tiers, disable_log_requests=True,
                              **settings_kw)
    app = build_app(engine, settings, metrics, tracer)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = build_server(app, log_level="warning", shutdown_timeout_s=2, header_read_timeout_s=header_read_timeout_s,
                          backlog=512)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    live = LiveServer(f"http://127.0.0.1:{port}", engine, metrics, media_dir, server, thread, tracer, app)
    assert httpx.get(live.base_url + "/health", timeout=10).status_code == 200
    return live


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen2_vl(tmp_path_factory.mktemp("server-ckpt"), seed=7)


def make_llm(ckpt: Path, **kwargs: Any) -> LLM:
    opts: dict[str, Any] = dict(device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_tokens=8192, max_num_seqs=64)
    opts.update(kwargs)
    return LLM(str(ckpt), **opts)


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("media")
    (d / "pic.png").write_bytes(png_bytes(56, 56, seed=3))
    return d


@pytest.fixture(scope="session")
def span_exporter() -> Any:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    return InMemorySpanExporter()


@pytest.fixture(scope="session")
def live(tiny_ckpt: Path, media_dir: Path, span_exporter: Any) -> Iterator[LiveServer]:
    from flashvlm.server.tracing import Tracer

    tracer = Tracer.create(None, exporter=span_exporter)
    server = start_server(make_llm(tiny_ckpt), media_dir, tracer=tracer)
    yield server
    server.stop()
