"""`n` on chat and completions through the official `openai` client against a live server: one choice per
completion (index 0..n-1), each with its own finish_reason and logprobs; streams interleave chunks per choice; usage
counts the prompt once; the prompt (image included) is computed once; a client leaving mid-stream frees every
block of every sample."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, data_uri, image_message, png_bytes


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=60)


def _messages(seed: int) -> list[dict[str, Any]]:
    return image_message(f"Picture number {seed}: what does it show?", data_uri(png_bytes(seed=seed)))


def _prompt_tokens(live: LiveServer, messages: list[dict[str, Any]]) -> int:
    return len(live.engine.engine.process_chat(json.loads(json.dumps(messages))).prompt_token_ids)


def test_chat_n_with_an_image_computes_the_prompt_once(live: LiveServer, client: openai.OpenAI) -> None:
    messages = _messages(101)
    live.wait_idle()
    before = live.engine.stats()
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=4, seed=7, temperature=1.0,
                                         extra_body={"ignore_eos": True})
    after = live.wait_idle()
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" and c.message.role == "assistant" for c in out.choices)
    assert len({c.message.content for c in out.choices}) > 1, "seeded samples draw from different seeds"
    p = _prompt_tokens(live, messages)
    assert out.usage.prompt_tokens == p  # once, not n times
    assert out.usage.completion_tokens == 4 * 6 and out.usage.total_tokens == p + 24
    bs = live.engine.engine.config.cache.block_size
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    # Sample 0 may find the chat template's opening block cached from other requests; it computes the rest once.
    cached = out.usage.prompt_tokens_details.cached_tokens
    assert cached < p - bs
    assert queries == 4 * p and hits == cached + 3 * ((p - 1) // bs * bs), "samples 1..3 share sample 0's prompt"
    assert after["images_encoded"] - before["images_encoded"] == 1
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=4, seed=7,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_chat_n_streamed_equals_the_whole_response(live: LiveServer, client: openai.OpenAI) -> None:
    messages = _messages(102)
    kw: dict[str, Any] = dict(model=MODEL, messages=messages, max_tokens=7, n=4, seed=11, temperature=1.0,
                              logprobs=True,
                              top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text: dict[int, str] = defaultdict(str)
    roles: dict[int, int] = defaultdict(int)
    finishes: dict[int, list[str]] = defaultdict(list)
    logprobs: dict[int, list[Any]] = defaultdict(list)
    for c in chunks[:-1]:
        assert len(c.choices) == 1 and c.usage is None
        choice = c.choices[0]
        if choice.delta.role:
            roles[choice.index] += 1
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            assert not finishes[choice.index] or False, "one finish chunk per choice"
            finishes[choice.index].append(choice.finish_reason)
        elif finishes[choice.index]:
            raise AssertionError(f"choice {choice.index} got a chunk after its finish")
        if choice.logprobs is not None and choice.logprobs.content:
            logprobs[choice.index] += choice.logprobs.content
    assert dict(roles) == {0: 1, 1: 1, 2: 1, 3: 1}
    assert dict(finishes) == {i: ["length"] for i in range(4)}
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.usage.completion_tokens == 28
    for c in whole.choices:
        assert text[c.index] == c.message.content
        assert len(c.logprobs.content) == 7
        # The second run finds the prompt cached, so sample 0 computes only its tail: the same values up to
        # float rounding.
        streamed = logprobs[c.index]
        assert [e.token for e in streamed] == [e.token for e in c.logprobs.content]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, c.logprobs.content))
    # Chunks of different choices interleave: every choice's content arrives before the last choice finishes.
    indices = [c.choices[0].index for c in chunks[:-1] if c.choices[0].delta.content]
    assert indices != sorted(indices)


def test_greedy_n_returns_n_copies(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0)
    four = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0, n=4)
    assert [c.message.content for c in four.choices] == [one.choices[0].message.content] * 4
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens


def test_completions_n_streamed_and_not(live: LiveServer, client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, prompt="Once upon a time, in a land far away,", max_tokens=6, n=3,
                              seed=5, temperature=1.0, logprobs=1, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 6 for c in whole.choices)
    assert whole.usage.completion_tokens == 18
    assert whole.usage.prompt_tokens == len(live.engine.engine.tokenizer.encode(kw["prompt"]))
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text: dict[int, str] = defaultdict(str)
    tokens: dict[int, list[str]] = defaultdict(list)
    offsets: dict[int, list[int]] = defaultdict(list)
    finishes: dict[int, list[str]] = defaultdict(list)
    for c in chunks[:-1]:
        (choice,) = c.choices
        text[choice.index] += choice.text
        if choice.logprobs is not None:
            tokens[choice.index] += choice.logprobs.tokens
            offsets[choice.index] += choice.logprobs.text_offset
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert dict(finishes) == {i: ["length"] for i in range(3)}
    assert chunks[-1].usage.completion_tokens == 18 and chunks[-1].choices == []
    for c in whole.choices:
        assert text[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens and offsets[c.index] == c.logprobs.text_offset


def test_client_leaving_mid_stream_frees_every_sample(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    live.wait_idle()
    scheduler = live.engine.engine.scheduler
    ended: list[tuple[str, str]] = []  # (scheduler id, status) of every sample that leaves the scheduler
    finish = scheduler._finish

    def recording_finish(req: Any, status: Any) -> None:
        ended.append((req.request_id, status.value))
        finish(req, status)

    monkeypatch.setattr(scheduler, "_finish", recording_finish)
    baseline = live.engine.stats()
    assert baseline["num_free_blocks"] == baseline["num_usable_blocks"]
    body = {"model": MODEL, "messages": _messages(103), "max_tokens": 150, "n": 4, "stream": True,
            "temperature": 1.0, "ignore_eos": True}
    seen: set[int] = set()
    with httpx.stream("POST", live.v1 + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                if choice["delta"].get("content"):
                    seen.add(choice["index"])
            if len(seen) == 4:
                break  # every sample is decoding; hang up
    stats = live.wait_idle()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_usable_blocks"], "the aborted samples' blocks must be freed"
    assert not scheduler.requests
    # Every sample was aborted, none ran on to its max_tokens after the client left.
    assert sorted(status for _, status in ended) == ["abort"] * 4
    base = min((rid for rid, _ in ended), key=len)
    assert sorted(rid for rid, _ in ended) == [base, f"{base}#1", f"{base}#2", f"{base}#3"]


@pytest.mark.parametrize("n", [0, -3, 1.5, "4", 17])
def test_bad_n_is_a_400(live: LiveServer, n: Any) -> None:
    for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/completions", {"prompt": "x"})):
        r = httpx.post(live.v1 + path, json={"model": MODEL, **body, "n": n}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n"


def _metric_sums(live: LiveServer) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(live.base_url + "/metrics", timeout=30)
    sums: dict[str, float] = defaultdict(float)
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            sums[s.name] += s.value
    return sums


def test_metrics_count_one_request_and_every_completion_token(live: LiveServer, client: openai.OpenAI) -> None:
    live.wait_idle()
    before = _metric_sums(live)
    out = client.completions.create(model=MODEL, prompt="Metrics for a request with three samples", max_tokens=5,
                                    n=3, temperature=1.0, extra_body={"ignore_eos": True})
    live.wait_idle()
    after = _metric_sums(live)
    assert after["flashvlm:request_success_total"] - before["flashvlm:request_success_total"] == 1
    assert after["flashvlm:generation_tokens_total"] - before["flashvlm:generation_tokens_total"] == 15
    assert after["flashvlm:prompt_tokens_total"] - before["flashvlm:prompt_tokens_total"] == out.usage.prompt_tokens


def test_a_fault_in_one_sample_fails_the_request_and_frees_every_sample(live: LiveServer,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    runner = live.engine.engine.runner
    real = runner.execute

    def faulty(out: Any) -> Any:  # only once sample 2 runs, after sample 0 computed the prompt
        if any(s.request.request_id.startswith("boomn-") and s.request.request_id.endswith("#2")
               for s in out.scheduled):
            raise RuntimeError("injected fault")
        return real(out)

    monkeypatch.setattr(runner, "execute", faulty)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "n": 3,
            "request_id": "boomn-1"}
    r = httpx.post(live.v1 + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    stats = live.wait_idle()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"] and not live.engine.engine.scheduler.requests
    ok = httpx.post(live.v1 + "/chat/completions", json={**body, "request_id": "fine-1"}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


def test_best_of_equal_to_n_is_served(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Two samples", max_tokens=3, n=2, best_of=2)
    assert [c.index for c in out.choices] == [0, 1]
