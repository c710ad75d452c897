"""Bad input is a 4xx OpenAI-style JSON error naming the problem, never a 5xx, and the server keeps serving."""

from __future__ import annotations

import io
import os
import socket
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from flashvlm.request import MAX_NUM_SAMPLES
from flashvlm.server.protocol import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.server.conftest import (
    LIMIT_IMAGES,
    MAX_IMAGE_BYTES,
    MAX_MODEL_LEN,
    MODEL,
    LiveServer,
    data_uri,
    image_message,
    png_bytes,
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
_OK_IMAGE = data_uri(png_bytes(seed=2))


def _blank_png(w: int, h: int) -> bytes:
    """A small file whose header says w x h pixels: the pixel limit must refuse it from the header alone."""
    buf = io.BytesIO()
    Image.new("L", (w, h)).save(buf, format="PNG")
    return buf.getvalue()


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _img_chat(*uris: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": image_message("What is it?", *uris), "max_tokens": 2}


def _video_chat(url: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]}]}


# (id, path, body (dict, or raw bytes), status, needle in the message)
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

CASES: list[tuple[str, str, Any, int, str]] = [
    ("malformed-json", CHAT, b'{"model": "tiny-vlm", "messages": [', 400, "not valid json"),
    ("not-an-object", CHAT, b"[1, 2]", 400, "valid dictionary"),
    ("nan-literal", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 400,
     "temperature"),
    ("missing-messages", CHAT, {"model": MODEL, "max_tokens": 2}, 400, "messages"),
    ("empty-messages", CHAT, _chat(messages=[]), 400, "messages"),
    ("bad-role", CHAT, _chat(messages=[{"role": "wizard", "content": "x"}]), 400, "role"),
    ("unknown-part-type", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "x"}}]}]), 400, "audio_url"),
    ("image-url-not-object", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": 5}]}]), 400, "image_url"),
    ("invalid-base64", CHAT, _img_chat("data:image/png;base64,!!!notbase64!!!"), 400, "base64"),
    ("data-uri-not-base64", CHAT, _img_chat("data:image/png,rawdata"), 400, "data uri"),
    ("corrupt-image", CHAT, _img_chat(data_uri(b"\x89PNG\r\n\x1a\n" + os.urandom(64))), 400, "decode"),
    ("truncated-image", CHAT, _img_chat(data_uri(png_bytes(seed=4)[:200])), 400, "image 0"),
    ("not-an-image", CHAT, _img_chat(data_uri(b"hello world, plain text")), 400, "decode"),
    ("image-over-byte-limit", CHAT, _img_chat(data_uri(png_bytes(200, 200, seed=5))), 400, "bytes"),
    ("image-over-pixel-limit", CHAT, _img_chat(data_uri(_blank_png(600, 600))), 400, "pixels"),
    ("corrupt-video", CHAT, _video_chat("data:video/mp4;base64,AAAAAAAA"), 400, "video 0"),
    ("remote-video", CHAT, _video_chat("https://example.com/a.mp4"), 400, "remote video"),
    ("too-many-images", CHAT, _img_chat(*[_OK_IMAGE] * (LIMIT_IMAGES + 1)), 400, "at most"),
    ("prompt-too-long", CHAT, _chat(messages=[{"role": "user", "content": "fox " * MAX_MODEL_LEN}]), 400,
     "max_model_len"),
    ("max-tokens-past-context", CHAT, _chat(max_tokens=MAX_MODEL_LEN), 400, "context length"),
    ("temperature-negative", CHAT, _chat(temperature=-1), 400, "temperature"),
    ("temperature-string", CHAT, _chat(temperature="hot"), 400, "temperature"),
    ("top-p-zero", CHAT, _chat(top_p=0), 400, "top_p"),
    ("top-p-above-one", CHAT, _chat(top_p=1.5), 400, "top_p"),
    ("max-tokens-zero", CHAT, _chat(max_tokens=0), 400, "max_tokens"),
    ("top-k-negative", CHAT, _chat(top_k=-5), 400, "top_k"),
    ("min-p-above-one", CHAT, _chat(min_p=2.0), 400, "min_p"),
    ("repetition-penalty-zero", CHAT, _chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("min-tokens-above-max", CHAT, _chat(min_tokens=5, max_tokens=2), 400, "min_tokens"),
    ("stop-token-negative", CHAT, _chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("empty-stop-string", CHAT, _chat(stop=[""]), 400, "stop"),
    ("seed-out-of-range", CHAT, _chat(seed=2**70), 400, "seed"),
    ("n-zero", CHAT, _chat(n=0), 400, "n: "),
    ("n-negative", CHAT, _chat(n=-1), 400, "n: "),
    ("n-fraction", CHAT, _chat(n=2.5), 400, "n: "),
    ("n-string", CHAT, _chat(n="2"), 400, "n: "),
    ("n-bool", CHAT, _chat(n=True), 400, "n: "),
    ("n-above-max", CHAT, _chat(n=MAX_NUM_SAMPLES + 1), 400, "n: "),
    ("completion-n-above-max", COMPLETIONS, {"model": MODEL, "prompt": "a", "n": MAX_NUM_SAMPLES + 1}, 400, "n: "),
    ("completion-best-of", COMPLETIONS, {"model": MODEL, "prompt": "a", "n": 2, "best_of": 3}, 400, "best_of=3"),
    ("chat-best-of", CHAT, _chat(best_of=2), 400, "best_of=2"),
    ("top-logprobs-above-20", CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs must be"),
    ("top-logprobs-negative", CHAT, _chat(logprobs=True, top_logprobs=-1), 400, "top_logprobs must be"),
    ("top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), 400, "needs logprobs: true"),
    ("top-logprobs-with-logprobs-false", CHAT, _chat(logprobs=False, top_logprobs=0), 400, "needs logprobs"),
    ("completion-logprobs-above-20", COMPLETIONS, {"model": MODEL, "prompt": "a", "logprobs": 21}, 400,
     "logprobs must be"),
    ("completion-logprobs-negative", COMPLETIONS, {"model": MODEL, "prompt": "a", "logprobs": -2}, 400,
     "logprobs must be"),
    ("presence-penalty", CHAT, _chat(presence_penalty=0.5), 400, "presence_penalty"),
    ("tool-choice-without-tools", CHAT, _chat(tool_choice="auto"), 400, "only allowed when tools"),
    ("tool-choice-unknown-function", CHAT, _chat(tools=[_TOOL], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "not in tools"),
    ("tool-bad-name", CHAT, _chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400, "name"),
    ("tools-not-a-list", CHAT, _chat(tools={"type": "function"}), 400, "tools"),
    ("tools-twice", CHAT, _chat(tools=[_TOOL, _TOOL]), 400, "same function twice"),
    ("tool-history-without-function", CHAT, {"model": MODEL, "messages": [
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]}, 400, "function"),
    ("unknown-response-format", CHAT, _chat(response_format={"type": "xml"}), 400, "response_format"),
    ("request-id-with-newline", CHAT, _chat(request_id="a\r\nx-evil: 1"), 400, "request_id"),
    ("unknown-model", CHAT, _chat(model="gpt-5"), 404, "does not exist"),
    ("unknown-sla-tier", CHAT, _chat(sla_tier="platinum"), 400, "platinum"),
    ("file-outside-allowed-dir", CHAT, _img_chat("/etc/hostname"), 403, "outside"),
    ("file-url-outside", CHAT, _img_chat("file:///etc/hostname"), 403, "outside"),
    ("path-traversal", CHAT, _img_chat("../../../../etc/hostname"), 403, "outside"),
    ("file-missing-inside", CHAT, _img_chat("no-such-picture.png"), 400, "not found"),
    ("remote-url-disabled", CHAT, _img_chat("http://127.0.0.1:9/cat.png"), 400, "allow-remote-images"),
    ("unsupported-scheme", CHAT, _img_chat("ftp://example.com/cat.png"), 400, "scheme"),
    ("placeholder-in-text", CHAT, _chat(messages=[{"role": "user", "content": "<|image_pad|> sneaky"}]), 400,
     "placeholder"),
    ("completion-empty-prompt", COMPLETIONS, {"model": MODEL, "prompt": ""}, 400, "empty"),
    ("completion-ids-out-of-vocab", COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "vocabulary"),
    ("completion-batch", COMPLETIONS, {"model": MODEL, "prompt": ["a", "b"]}, 400, "batched"),
    ("completion-echo", COMPLETIONS, {"model": MODEL, "prompt": "a", "echo": True}, 400, "echo"),
    ("completion-missing-prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    ("unknown-route", "/v1/embeddings", {"input": "x"}, 404, "not found"),
    ("too-many-stop-strings", CHAT, _chat(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]), 400,
     f"at most {MAX_STOP_STRINGS} stop strings"),
    ("stop-string-too-long", CHAT, _chat(stop="x" * (MAX_STOP_STRING_CHARS + 1)), 400,
     f"at most {MAX_STOP_STRING_CHARS} characters"),
    ("stream-options-without-stream", CHAT, _chat(stream_options={"include_usage": True}), 400, "stream"),
    ("completion-bool-token-ids", COMPLETIONS, {"model": MODEL, "prompt": [True, 2]}, 400, "not true"),
    ("completion-nested-bool-token-ids", COMPLETIONS, {"model": MODEL, "prompt": [[1, False]]}, 400, "integers"),
    ("stop-token-id-bool", CHAT, _chat(stop_token_ids=[True]), 400, "stop_token_ids"),
    ("pruning-ratio-zero", CHAT, {**_img_chat(_OK_IMAGE), "mm_processor_kwargs": {"mm_token_keep_ratio": 0}}, 400,
     "mm_token_keep_ratio must be in (0, 1]"),
    ("pruning-ratio-above-one", CHAT, _chat(mm_processor_kwargs={"mm_token_keep_ratio": 1.5}), 400,
     "mm_token_keep_ratio must be in (0, 1]"),
    ("pruning-ratio-string", CHAT, {**_img_chat(_OK_IMAGE), "mm_processor_kwargs": {"mm_token_keep_ratio": "abc"}},
     400, "mm_token_keep_ratio must be a number"),
    ("pruning-unknown-strategy", CHAT, _chat(mm_processor_kwargs={"mm_token_pruning": "fastv"}), 400,
     "unknown visual-token pruning strategy"),
    ("pruning-dedup-threshold-out-of-range", CHAT,
     {**_img_chat(_OK_IMAGE), "mm_processor_kwargs": {"mm_token_pruning": "dedup", "mm_token_dedup_threshold": 256}},
     400, "mm_token_dedup_threshold must be in [0, 255]"),
    ("pruning-dedup-threshold-string", CHAT,
     _chat(mm_processor_kwargs={"mm_token_pruning": "dedup", "mm_token_dedup_threshold": "high"}), 400,
     "mm_token_dedup_threshold must be a number"),
]



def _post(live: LiveServer, path: str, body: Any, **kw: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(live.base_url + path, content=body, headers={"content-type": "application/json"},
                          timeout=30, **kw)
    return httpx.post(live.base_url + path, json=body, timeout=30, **kw)


def _assert_error(r: httpx.Response, status: int, needle: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle.lower() in err["message"].lower(), err["message"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_4xx(live: LiveServer, case: tuple[str, str, Any, int, str]) -> None:
    _, path, body, status, needle = case
    _assert_error(_post(live, path, body), status, needle)


def test_server_keeps_serving_and_holds_nothing(live: LiveServer) -> None:
    for _, path, body, status, _ in CASES[:12]:
        assert _post(live, path, body).status_code == status
    r = _post(live, CHAT, _img_chat(_OK_IMAGE))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = live.wait_idle()
    assert stats["num_queued"] == 0 and stats["num_free_blocks"] == stats["num_usable_blocks"]


def test_oversized_body_refused_before_reading(live: LiveServer) -> None:
    limit = LIMIT_IMAGES * MAX_IMAGE_BYTES * 4 // 3 + 16 * 1024 * 1024
    host, port = live.base_url.removeprefix("http://").split(":")
    # Raw socket: the body is never sent, and the answer must come anyway (httpx would refuse the lie).
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {limit + 1}\r\n\r\n".encode())
        reply = b""
        while b"}}" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"limit" in body


def test_symlink_out_of_allowed_dir_refused(live: LiveServer) -> None:
    link = live.media_dir / "escape.png"
    if not link.exists():
        link.symlink_to("/etc/hostname")
    _assert_error(_post(live, CHAT, _img_chat(str(link))), 403, "outside")


# ---- fuzz: hypothesis-generated bodies, near-valid and not -------------------------------------
# Three families: valid bodies with valid-range options (they must answer 200), valid bodies with one field
# replaced by junk, and junk. Every generation is bounded by a small max_tokens so the run stays short.
_floats = st.floats(allow_nan=False, allow_infinity=False)
_json = st.recursive(st.none() | st.booleans() | st.integers() | _floats | st.text(max_size=20),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8)
_urls = st.sampled_from([_OK_IMAGE, "pic.png", "data:image/png;base64,AAAA", "data:,x", "/etc/passwd",
                         "http://127.0.0.1:9/x.png", "", "file:///", "data:image/png;base64," + "A" * 64])
_text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=40)})
_image_part = st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _urls})})
_valid_message = st.fixed_dictionaries({
    "role": st.sampled_from(["user", "system", "assistant", "developer"]),
    "content": st.text(max_size=60) | st.lists(_text_part | _image_part, max_size=3)})
_valid_options = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1), "repetition_penalty": st.floats(0.5, 2), "seed": st.integers(0, 2**63 - 1),
    "stop": st.text(max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=2), "min_tokens": st.integers(0, 1),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(), "priority": st.integers(-5, 5), "sla_tier": st.sampled_from(["gold", "bronze"]),
    "skip_special_tokens": st.booleans(), "user": st.text(max_size=5), "n": st.integers(1, 2),
}
_chat_base = st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
                                    "messages": st.lists(_valid_message, min_size=1, max_size=2)},
                                   optional=_valid_options)
_completion_base = st.fixed_dictionaries({"model": st.just(MODEL), "max_tokens": st.integers(1, 3),
                                          "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 600), max_size=5)},
                                         optional=_valid_options)
_field_names = sorted({*_valid_options, "model", "messages", "prompt", "max_completion_tokens", "logprobs",
                       "presence_penalty", "frequency_penalty", "mm_processor_kwargs", "request_id", "response_format",
                       "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"})


def _with_junk(base: st.SearchStrategy) -> st.SearchStrategy:
    # Replacing max_tokens with junk could make a valid request generate up to max_model_len; keep it.
    junk_field = st.sampled_from([f for f in _field_names if f != "max_tokens"])
    return st.builds(lambda body, key, value: {**body, key: value}, base, junk_field, _json)


_bodies = st.one_of(
    _chat_base.map(lambda b: (CHAT, b)), _completion_base.map(lambda b: (COMPLETIONS, b)),
    _with_junk(_chat_base).map(lambda b: (CHAT, b)), _with_junk(_completion_base).map(lambda b: (COMPLETIONS, b)),
    _json.map(lambda b: (CHAT, b)), st.binary(max_size=40).map(lambda b: (CHAT, b)),
)


@pytest.mark.slow
@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=_bodies)
def test_fuzz_never_5xx(live: LiveServer, body: tuple[str, Any]) -> None:
    path, payload = body
    r = _post(live, path, payload)
    assert r.status_code < 500, (payload, r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif isinstance(payload, dict) and payload.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("spec,limit", [("image=4", 4), ('{"image": 2}', 2), ("7", 7), ("image=0", 0)])
def test_limit_mm_per_prompt_spellings(spec: str, limit: int) -> None:
    from flashvlm.server.media import parse_limit_mm_per_prompt

    assert parse_limit_mm_per_prompt(spec) == limit


@pytest.mark.parametrize("spec", ["video=2", "image=many", "{not json", "image=-1"])
def test_limit_mm_per_prompt_refuses_nonsense(spec: str) -> None:
    from flashvlm.server.media import parse_limit_mm_per_prompt

    with pytest.raises(ValueError, match="limit-mm-per-prompt"):
        parse_limit_mm_per_prompt(spec)


def test_pruned_request_is_served_after_bad_pruning_settings(live: LiveServer) -> None:
    for case in CASES:
        if case[0].startswith("pruning-"):
            _assert_error(_post(live, case[1], case[2]), case[3], case[4])
    before = live.engine.engine.stats()["image_tokens_kept"]
    body = {**_img_chat(_OK_IMAGE), "mm_processor_kwargs": {"mm_token_pruning": "pool", "mm_token_keep_ratio": 0.5}}
    r = _post(live, CHAT, body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    live.wait_idle()
    # The 56x56 picture is a 2 x 2 merged grid on the tiny model: half of it is 2 tokens.
    assert live.engine.engine.stats()["image_tokens_kept"] - before == 2
    details = r.json()["usage"]["prompt_tokens_details"]
    assert (details["image_tokens"], details["image_tokens_kept"]) == (4, 2)
    # dedup on a flat picture: its 2 x 2 tokens are one tile of equal blocks, one token is kept.
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 210, 220)).save(buf, format="PNG")
    flat = {**_img_chat(data_uri(buf.getvalue())),
            "mm_processor_kwargs": {"mm_token_pruning": "dedup", "mm_token_keep_ratio": 1.0}}
    r = _post(live, CHAT, flat)
    assert r.status_code == 200
    details = r.json()["usage"]["prompt_tokens_details"]
    assert (details["image_tokens"], details["image_tokens_kept"]) == (4, 1)
