"""Log-probabilities over the live server (raw HTTP and the official `openai` client), chat and completions,
streamed and not: OpenAI's response shapes, and values equal to the log_softmax of the logits the engine produced
for each step (the runner's record_logits hook)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.server.conftest import MODEL, LiveServer

CHAT = "/chat/completions"
COMPLETIONS = "/completions"
TOL = 1e-5
MAX_TOKENS = 5


@pytest.fixture
def recorded(live: LiveServer) -> Iterator[dict[str, list[torch.Tensor]]]:
    runner = live.engine.engine.runner
    runner.record_logits = True
    runner.recorded_logits.clear()
    yield runner.recorded_logits
    runner.record_logits = False
    runner.recorded_logits.clear()


def _reference(recorded: dict[str, list[torch.Tensor]], client_id: str) -> list[torch.Tensor]:
    """The log_softmax of each step's logits of the request the client sent as `client_id`."""
    [rows] = [v for k, v in recorded.items() if k.startswith(client_id + "-")]
    return [row.float().log_softmax(dim=-1) for row in rows]


def _decode(live: LiveServer, token_id: int) -> str:
    return live.engine.engine.tokenizer.decode([token_id])


def _chat(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "request_id": request_id, **fields}


def _completion(request_id: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "request_id": request_id, **fields}


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(live.v1 + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(live: LiveServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", live.v1 + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(p) for p in lines[:-1]]


def _check_chat_content(live: LiveServer, content: list[dict[str, Any]], reference: list[torch.Tensor],
                        num_top: int) -> None:
    assert len(content) == len(reference) == MAX_TOKENS
    for entry, ref in zip(content, reference):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        top = entry["top_logprobs"]
        assert len(top) == num_top
        values, ids = ref.topk(num_top)
        for got, value, token_id in zip(top, values.tolist(), ids.tolist()):
            assert got["token"] == _decode(live, token_id) and abs(got["logprob"] - value) <= TOL
            assert got["bytes"] == list(got["token"].encode("utf-8"))
        # Greedy: the sampled token is the most likely one, and its value is the reference's maximum.
        assert abs(entry["logprob"] - ref.max().item()) <= TOL
        assert entry["token"] == _decode(live, int(ref.argmax()))


def test_chat_logprobs_match_the_engine(live: LiveServer, recorded: dict) -> None:
    body = _post(live, CHAT, _chat("lp-chat", logprobs=True, top_logprobs=4))
    content = body["choices"][0]["logprobs"]["content"]
    _check_chat_content(live, content, _reference(recorded, "lp-chat"), 4)
    assert "".join(e["token"] for e in content) == body["choices"][0]["message"]["content"]


def test_chat_logprobs_streamed_equal_the_whole_response(live: LiveServer, recorded: dict) -> None:
    whole = _post(live, CHAT, _chat("lp-whole", logprobs=True, top_logprobs=3))["choices"][0]["logprobs"]["content"]
    chunks = _stream(live, CHAT, _chat("lp-stream", logprobs=True, top_logprobs=3))
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == whole
    _check_chat_content(live, streamed, _reference(recorded, "lp-stream"), 3)
    text = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert "".join(e["token"] for e in streamed) == text


def test_chat_logprobs_without_top_and_without_logprobs(live: LiveServer) -> None:
    content = _post(live, CHAT, _chat("lp-zero", logprobs=True))["choices"][0]["logprobs"]["content"]
    assert len(content) == MAX_TOKENS and all(e["top_logprobs"] == [] and e["logprob"] <= 0 for e in content)
    assert _post(live, CHAT, _chat("lp-none"))["choices"][0]["logprobs"] is None
    assert all(ch["logprobs"] is None for c in _stream(live, CHAT, _chat("lp-none-s")) for ch in c["choices"])


def _check_completion_logprobs(live: LiveServer, lp: dict[str, Any], reference: list[torch.Tensor],
                               num_top: int) -> None:
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(reference)
    offset = 0
    for token, value, top, start, ref in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                             lp["text_offset"], reference):
        assert start == offset
        offset += len(token)
        assert token == _decode(live, int(ref.argmax())) and abs(value - ref.max().item()) <= TOL
        values, ids = ref.topk(num_top)
        expected = {_decode(live, t): v for t, v in zip(ids.tolist(), values.tolist())}
        assert top.keys() == expected.keys() and all(abs(top[k] - expected[k]) <= TOL for k in top)


def test_completion_logprobs_streamed_and_not(live: LiveServer, recorded: dict) -> None:
    body = _post(live, COMPLETIONS, _completion("lp-cmpl", logprobs=3))
    whole = body["choices"][0]["logprobs"]
    _check_completion_logprobs(live, whole, _reference(recorded, "lp-cmpl"), 3)
    assert "".join(whole["tokens"]) == body["choices"][0]["text"]
    chunks = _stream(live, COMPLETIONS, _completion("lp-cmpl-s", logprobs=3))
    merged: dict[str, list] = {k: [] for k in whole}
    for c in chunks:
        for ch in c["choices"]:
            for k, v in (ch["logprobs"] or {}).items():
                merged[k] += v
    assert merged == whole
    _check_completion_logprobs(live, merged, _reference(recorded, "lp-cmpl-s"), 3)


def test_through_the_openai_client(live: LiveServer, recorded: dict) -> None:
    client = openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Tell me a story"}]
    extra = {"ignore_eos": True, "request_id": "lp-oa"}
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body=extra)
    content = resp.choices[0].logprobs.content
    _check_chat_content(live, [c.model_dump() for c in content], _reference(recorded, "lp-oa"), 2)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True,
                                            extra_body={**extra, "request_id": "lp-oa-s"})
    streamed = [e for chunk in stream for ch in chunk.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.model_dump() for e in streamed] == [c.model_dump() for c in content]
    cmpl = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0,
                                     logprobs=2, extra_body={**extra, "request_id": "lp-oa-c"})
    _check_completion_logprobs(live, cmpl.choices[0].logprobs.model_dump(), _reference(recorded, "lp-oa-c"), 2)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, logprobs=True, top_logprobs=21)
