"""A video_url part (a data URI of a clip written here with PyAV) is answered like an image; a local path needs
the allowed media directory."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.e2e.test_video import _clip, _encode
from tests.server.conftest import MODEL, LiveServer

pytest.importorskip("av")


def _body(url: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "mm_processor_kwargs": {"video_min_pixels": 56 * 56},
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "What happens?"}]}]}


def test_video_data_uri_and_local_path(live: LiveServer) -> None:
    data = _encode(_clip(8, 56, 56, seed=1), fps=4)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    r = httpx.post(live.base_url + "/v1/chat/completions", json=_body(uri), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 8
    r = httpx.post(live.base_url + "/v1/chat/completions", json=_body("/etc/hostname"), timeout=60)
    assert r.status_code in (400, 403), r.text
