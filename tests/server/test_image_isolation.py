"""No request's images hold up another request: text-only chats are answered while every image worker is stuck,
one request's images get only their share of the workers, and each request's images stay within its budget
(pixels over all images, checked before any decode; decode seconds), refused with a 400 naming the flag.
Decoders block on Events; every wait is bounded and nothing asserts how long anything took."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer, data_uri, image_message, make_llm, png_bytes, start_server

WAIT_S = 60


class _StuckDecoder:
    """Stands in for InputProcessor.image_item: records which request's image entered, then waits for `release`
    before decoding it for real."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.lock = threading.Lock()
        self.entered: list[str] = []
        self.arrivals = threading.Semaphore(0)
        self.release = threading.Event()

    def __call__(self, src: Any, text: Any, index: int) -> Any:
        with self.lock:
            self.entered.append(text.family_kwargs.get("tag", "?"))
        self.arrivals.release()
        assert self.release.wait(WAIT_S), "the decoder was never released"
        return self.real(src, text, index)

    def wait_entered(self, n: int) -> None:
        for _ in range(n):
            assert self.arrivals.acquire(timeout=WAIT_S), f"only {self.entered} entered"


@pytest.fixture
def stuck(tiny_ckpt: Path, media_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LiveServer,
                                                                                                 _StuckDecoder]]:
    llm = make_llm(tiny_ckpt)
    processor = llm.engine.input_processor
    decoder = _StuckDecoder(processor.image_item)
    monkeypatch.setattr(processor, "image_item", decoder)
    # The tag rides in mm_processor_kwargs, which the family's processor must accept: let it through.
    real_make = processor.image_inputs.make_item
    monkeypatch.setattr(processor.image_inputs, "make_item", lambda image, kwargs, *a: real_make(
        image, {k: v for k, v in kwargs.items() if k != "tag"}, *a))
    server = start_server(llm, media_dir, with_metrics=False, image_threads=2, image_decodes_per_request=1,
                          media_kw={"limit_images": 4})
    yield server, decoder
    decoder.release.set()
    server.stop()


def _image_chat(live: LiveServer, tag: str, n: int) -> httpx.Response:
    uris = [data_uri(png_bytes(56, 56, seed=hash((tag, i)) % 1000)) for i in range(n)]
    return httpx.post(live.v1 + "/chat/completions", timeout=WAIT_S * 2, json={
        "model": MODEL, "messages": image_message("What is this?", *uris), "max_tokens": 2,
        "mm_processor_kwargs": {"tag": tag}})


def _text_chat(live: LiveServer) -> httpx.Response:
    return httpx.post(live.v1 + "/chat/completions", timeout=WAIT_S, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})


def test_text_only_is_answered_while_every_image_worker_is_stuck(
        stuck: tuple[LiveServer, _StuckDecoder]) -> None:
    live, decoder = stuck
    with ThreadPoolExecutor(2) as clients:
        heavy: list[Future[httpx.Response]] = [clients.submit(_image_chat, live, t, 4) for t in ("a", "b")]
        decoder.wait_entered(2)  # both image workers now hold a stuck decode
        for _ in range(3):
            r = _text_chat(live)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert not any(f.done() for f in heavy)
        # One image of each request entered: neither took both workers with its four images.
        assert sorted(decoder.entered) == ["a", "b"]
        stats = live.engine.stats()  # what /metrics reports as flashvlm:image_jobs_running / _waiting
        assert (stats["image_jobs_running"], stats["image_jobs_waiting"]) == (2, 6)
        decoder.release.set()
        for f in heavy:
            r = f.result(WAIT_S * 2)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
    assert sorted(decoder.entered) == ["a"] * 4 + ["b"] * 4
    stats = live.engine.stats()
    assert (stats["image_jobs_running"], stats["image_jobs_waiting"]) == (0, 0)


def test_a_late_request_gets_a_worker_before_an_earlier_one_finishes(
        stuck: tuple[LiveServer, _StuckDecoder]) -> None:
    live, decoder = stuck
    with ThreadPoolExecutor(2) as clients:
        first = clients.submit(_image_chat, live, "many", 4)
        decoder.wait_entered(1)
        second = clients.submit(_image_chat, live, "late", 1)
        decoder.wait_entered(1)  # the second worker went to the late request, not to "many"'s next image
        assert decoder.entered == ["many", "late"]
        decoder.release.set()
        assert first.result(WAIT_S * 2).status_code == 200
        assert second.result(WAIT_S * 2).status_code == 200


def test_pixel_budget_is_checked_before_any_decode(tiny_ckpt: Path, media_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    llm = make_llm(tiny_ckpt)
    decoded: list[int] = []
    real = llm.engine.input_processor.image_item
    monkeypatch.setattr(llm.engine.input_processor, "image_item",
                        lambda src, text, i: decoded.append(i) or real(src, text, i))
    live = start_server(llm, media_dir, with_metrics=False, media_kw={"max_request_pixels": 2 * 56 * 56})
    try:
        pic = data_uri(png_bytes(56, 56, seed=1))
        ok = httpx.post(live.v1 + "/chat/completions", timeout=WAIT_S, json={
            "model": MODEL, "messages": image_message("x", pic, pic), "max_tokens": 1})
        assert ok.status_code == 200, ok.text  # exactly at the budget
        decoded.clear()
        big = data_uri(png_bytes(57, 56, seed=2))
        r = httpx.post(live.v1 + "/chat/completions", timeout=WAIT_S, json={
            "model": MODEL, "messages": image_message("x", pic, big), "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "image_budget_exceeded" and "--max-request-image-pixels" in err["message"]
        assert str(56 * 56 + 57 * 56) in err["message"]
        assert decoded == []
    finally:
        live.stop()


def test_decode_time_budget(tiny_ckpt: Path, media_dir: Path) -> None:
    live = start_server(make_llm(tiny_ckpt), media_dir, with_metrics=False,
                        media_kw={"max_request_decode_s": 1e-9})  # any real decode takes longer
    try:
        r = httpx.post(live.v1 + "/chat/completions", timeout=WAIT_S, json={
            "model": MODEL, "messages": image_message("x", data_uri(png_bytes(56, 56))), "max_tokens": 1})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "image_budget_exceeded" and "--max-request-decode-seconds" in err["message"]
        assert _text_chat(live).status_code == 200
    finally:
        live.stop()


def test_budget_bounds_are_checked() -> None:
    from flashvlm.server.media import MediaPolicy

    with pytest.raises(ValueError, match="--max-request-image-pixels"):
        MediaPolicy(max_request_pixels=0)
    with pytest.raises(ValueError, match="--max-request-decode-seconds"):
        MediaPolicy(max_request_decode_s=0)


def test_the_flags() -> None:
    from flashvlm.cli import build_parser
    from flashvlm.server.cli import run

    args = build_parser().parse_args(["serve"])
    assert (args.image_decode_threads, args.image_decodes_per_request) == (None, None)
    assert (args.max_request_image_pixels, args.max_request_decode_seconds) == (200_000_000, 30.0)
    args = build_parser().parse_args(["serve", "--image-decode-threads", "6", "--image-decodes-per-request", "2",
                                      "--max-request-image-pixels", "1000", "--max-request-decode-seconds", "2.5"])
    assert (args.image_decode_threads, args.image_decodes_per_request) == (6, 2)
    assert (args.max_request_image_pixels, args.max_request_decode_seconds) == (1000, 2.5)
    for flag in ("--image-decode-threads", "--image-decodes-per-request"):
        with pytest.raises(ValueError, match=flag):  # before any model is loaded
            run(build_parser().parse_args(["serve", flag, "0"]))
    with pytest.raises(ValueError, match="--max-request-decode-seconds"):
        run(build_parser().parse_args(["serve", "--max-request-decode-seconds", "0"]))
