"""A video_url part (a data URI of a clip written here with PyAV) is answered like an image; a local path needs
the allowed media directory; video errors name the video and its own byte limit (--max-video-bytes)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.e2e.test_video import _clip, _encode
from tests.server.conftest import MODEL, LiveServer

pytest.importorskip("av")


def _body(url: str) -> dict:
    return {"model": MODEL, "max_tokens": 2, "mm_processor_kwargs": {"video_min_pixels": 56 * 56},
            "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                      {"type": "text", "text": "What happens?"}]}]}


def _post(live: LiveServer, url: str) -> httpx.Response:
    return httpx.post(live.base_url + "/v1/chat/completions", json=_body(url), timeout=60)


@contextmanager
def _video_limit(live: LiveServer, limit: int) -> Iterator[None]:
    policy = live.app.state.serving.settings.media
    saved, policy.max_video_bytes = policy.max_video_bytes, limit
    try:
        yield
    finally:
        policy.max_video_bytes = saved


def test_video_data_uri_and_local_path(live: LiveServer) -> None:
    data = _encode(_clip(8, 56, 56, seed=1), fps=4)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    r = _post(live, uri)
    assert r.status_code == 200, r.text
    tokens = r.json()["usage"]["prompt_tokens"]
    assert tokens > 8
    (live.media_dir / "clip.mp4").write_bytes(data)
    r = _post(live, "clip.mp4")
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == tokens
    r = _post(live, "/etc/hostname")
    assert r.status_code == 403, r.text
    assert r.json()["error"]["message"].startswith("video 0:")


def test_video_byte_limit_and_errors(live: LiveServer) -> None:
    """Over --max-video-bytes (data URI and local file), with images' own 20 MiB limit not applying; a non-video
    data URI, bad base64, a missing file, a corrupt file: each a 400 naming the video; the server keeps serving."""
    data = _encode(_clip(8, 56, 56, seed=2), fps=4)
    (live.media_dir / "limit.mp4").write_bytes(data)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    with _video_limit(live, len(data) - 1):
        for url in (uri, "limit.mp4", f"file://{live.media_dir / 'limit.mp4'}"):
            r = _post(live, url)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "video_too_large" and "--max-video-bytes" in err["message"], err
            assert err["message"].startswith(f"video 0 is {len(data)} bytes"), err
    with _video_limit(live, len(data)):
        assert _post(live, uri).status_code == 200
    (live.media_dir / "corrupt.mp4").write_bytes(b"\0not a video" * 10)
    for url, code, text in (("data:image/png;base64,AAAA", "invalid_video_url", "media type must be video/*"),
                            ("data:video/mp4;base64,@@@@", "invalid_base64", "invalid base64"),
                            ("data:video/mp4,plain", "invalid_video_url", "data:video/mp4;base64"),
                            ("missing.mp4", "invalid_video_url", "file not found"),
                            ("ftp://host/clip.mp4", "invalid_video_url", "unsupported URL scheme"),
                            ("https://host/clip.mp4", "invalid_video_url", "not fetched"),
                            ("corrupt.mp4", None, "cannot decode")):
        r = _post(live, url)
        assert r.status_code == 400, (url, r.text)
        err = r.json()["error"]
        assert err["message"].startswith("video 0") and text in err["message"], (url, err)
        assert code is None or err["code"] == code, (url, err)
    assert _post(live, uri).status_code == 200


def test_max_video_bytes_flag() -> None:
    import argparse

    from flashvlm.server.cli import build_parser
    from flashvlm.server.limits import DEFAULT_MAX_VIDEO_BYTES
    from flashvlm.server.media import MediaPolicy

    parser = argparse.ArgumentParser()
    build_parser(parser.add_subparsers())
    assert parser.parse_args(["serve"]).max_video_bytes == DEFAULT_MAX_VIDEO_BYTES == 256 * 2**20
    assert parser.parse_args(["serve", "--max-video-bytes", "1000"]).max_video_bytes == 1000
    with pytest.raises(ValueError, match="--max-video-bytes"):
        MediaPolicy(max_video_bytes=0)
    from types import SimpleNamespace

    from flashvlm.server.app import _max_body_bytes

    mib = 2**20
    small = MediaPolicy(max_image_bytes=mib, limit_images=2, max_video_bytes=mib)
    large = MediaPolicy(max_image_bytes=mib, limit_images=2, max_video_bytes=8 * mib)
    assert _max_body_bytes(SimpleNamespace(media=small)) == 2 * mib * 4 // 3 + 16 * mib  # the images'
    assert _max_body_bytes(SimpleNamespace(media=large)) == 8 * mib * 4 // 3 + 16 * mib  # one video's
