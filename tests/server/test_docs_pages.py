"""/docs and /redoc load Swagger UI / ReDoc from a CDN, so they are off unless `--enable-docs` asks for them;
/openapi.json (what clients and tools read) is always served."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from flashvlm.cli import build_parser
from flashvlm.server.app import build_app
from flashvlm.server.serving import ServerSettings
from tests.server.conftest import MODEL, LiveServer


def test_docs_pages_are_off_by_default(live: LiveServer) -> None:
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        r = httpx.get(live.base_url + path, timeout=10)
        assert r.status_code == 404, (path, r.status_code)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    spec = httpx.get(live.base_url + "/openapi.json", timeout=10)
    assert spec.status_code == 200 and "/v1/chat/completions" in spec.json()["paths"]


def test_enable_docs_serves_both_pages(live: LiveServer) -> None:
    app = build_app(live.engine, ServerSettings(served_model_names=[MODEL], enable_docs=True))
    with TestClient(app) as client:
        for path, needle in (("/docs", "swagger-ui"), ("/redoc", "redoc")):
            r = client.get(path)
            assert r.status_code == 200 and needle in r.text.lower(), path
            assert "/openapi.json" in r.text


def test_the_flag() -> None:
    assert build_parser().parse_args(["serve"]).enable_docs is False
    assert build_parser().parse_args(["serve", "--enable-docs"]).enable_docs is True
