"""Concurrency and overload: 64 concurrent streams match offline generation token for token; a burst past the
admission bound gets 429s with Retry-After while every admitted request completes and the queue stays bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from flashvlm import LLM, SamplingParams
from flashvlm.server.admission import QueueFullError
from tests.server.conftest import MODEL, LiveServer, data_uri, image_message, make_llm, png_bytes, start_server

NUM_CONCURRENT = 64


def _workload() -> list[tuple[str, Any, int]]:
    """(endpoint, chat messages or completion prompt, max_tokens); a few images shared, as real traffic has."""
    images = [data_uri(png_bytes(28 * (1 + i % 3), 56, seed=i)) for i in range(6)]
    work: list[tuple[str, Any, int]] = []
    for i in range(NUM_CONCURRENT):
        max_tokens = 4 + i % 9
        if i % 4 == 3:
            work.append(("completions", f"Numbers: {i} {i * 7} and the quick brown fox", max_tokens))
        elif i % 4 == 2:
            work.append(("chat", [{"role": "user", "content": f"Describe item {i}."}], max_tokens))
        else:
            uris = [images[i % 6]] + ([images[(i + 1) % 6]] if i % 8 == 0 else [])
            work.append(("chat", image_message(f"What is in picture {i}?", *uris), max_tokens))
    return work


@pytest.fixture(scope="module")
def reference(tiny_ckpt: Path) -> list[tuple[str, int, int]]:
    """Offline LLM.chat / LLM.generate on the same prompts: (text, prompt tokens, completion tokens)."""
    llm = make_llm(tiny_ckpt)
    out = []
    for kind, prompt, max_tokens in _workload():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        res = llm.chat(prompt, params)[0] if kind == "chat" else llm.generate(prompt, params)[0]
        out.append((res.text, len(res.prompt_token_ids), len(res.token_ids)))
    return out


async def _stream_one(client: openai.AsyncOpenAI, kind: str, prompt: Any, max_tokens: int) -> tuple[str, int, int]:
    common: dict[str, Any] = dict(model=MODEL, max_tokens=max_tokens, temperature=0.0, stream=True,
                                  stream_options={"include_usage": True})
    if kind == "chat":
        stream = await client.chat.completions.create(messages=prompt, **common)
    else:
        stream = await client.completions.create(prompt=prompt, **common)
    text, usage = [], None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append((choice.delta.content or "") if kind == "chat" else choice.text)
    assert usage is not None
    return "".join(text), usage.prompt_tokens, usage.completion_tokens


def test_64_concurrent_streams_match_offline(live: LiveServer, reference: list[tuple[str, int, int]]) -> None:
    async def run() -> list[tuple[str, int, int]]:
        async with openai.AsyncOpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(_stream_one(client, *w) for w in _workload()))

    results = asyncio.run(run())
    mismatches = [(i, got, want) for i, (got, want) in enumerate(zip(results, reference)) if got != want]
    assert not mismatches, mismatches[:3]
    stats = live.wait_idle()
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


def test_async_engine_generate_stopped_early_aborts(live: LiveServer) -> None:
    """The engine API itself, from another event loop than the server's: leaving generate() early aborts."""
    engine = live.engine
    aborted = engine.stats()["num_aborted"]

    async def run() -> int:
        seen = 0
        agen = engine.generate({"prompt": "Once upon a time"}, SamplingParams(max_tokens=200, ignore_eos=True))
        async for out in agen:
            seen = len(out.token_ids)
            if seen >= 2:
                break
        await agen.aclose()
        return seen

    assert asyncio.run(run()) >= 2
    stats = live.wait_idle()
    assert stats["num_aborted"] == aborted + 1 and stats["num_free_blocks"] == stats["num_usable_blocks"]


@pytest.fixture(scope="module")
def small_server(tiny_ckpt: Path, media_dir: Path) -> Iterator[LiveServer]:
    """Two running slots and at most 4 waiting requests: easy to overload."""
    llm: LLM = make_llm(tiny_ckpt, max_num_seqs=2, kv_cache_tokens=2048)
    server = start_server(llm, media_dir, max_waiting_requests=4, with_metrics=False)
    yield server
    server.stop()


def test_overload_gets_429_with_retry_after_and_stays_bounded(small_server: LiveServer) -> None:
    burst = 40
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> httpx.Response:
                return await client.post(small_server.v1 + "/chat/completions",
                                         json={**body, "stream": i % 2 == 0})
            return await asyncio.gather(*(one(i) for i in range(burst)))

    responses = asyncio.run(run())
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == burst, sorted({r.status_code for r in responses})
    assert refused and ok
    for r in refused:
        assert int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "queue_full"
    for r in ok:  # every admitted request ran to its full length
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in r.text
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
    admission = small_server.engine.admission
    assert admission.peak_queued <= admission.max_waiting  # one tier: the bound is exact
    stats = small_server.wait_idle()
    assert stats["num_queued"] == 0 and stats["num_free_blocks"] == stats["num_usable_blocks"]
    assert httpx.post(small_server.v1 + "/chat/completions", json=body, timeout=60).status_code == 200


def test_admission_lets_a_better_tier_past_a_full_queue(small_server: LiveServer) -> None:
    engine = small_server.engine
    bronze = [engine.reserve(priority=2) for _ in range(engine.admission.max_waiting)]
    try:
        with pytest.raises(QueueFullError):
            engine.reserve(priority=2)
        gold = engine.reserve(priority=0)  # nothing of its tier or better waits: admitted
        gold.release()
        r = httpx.post(small_server.v1 + "/chat/completions", headers={"x-sla-tier": "bronze"},
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, timeout=30)
        assert r.status_code == 429 and "Retry-After" in r.headers
    finally:
        for slot in bronze:
            slot.release()
    assert engine.stats()["num_queued"] == 0


class _FixedBudget:
    """A budget controller that records what the engine feeds it and asks for a fixed budget."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.calls: list[tuple[float, int, set[str]]] = []

    def update(self, step_latency_s: float, num_decode_seqs: int, active_tiers: Any) -> int:
        self.calls.append((step_latency_s, num_decode_seqs, set(active_tiers)))
        return self.budget


def test_budget_controller_steers_the_scheduler_and_shutdown_refuses_work(tiny_ckpt: Path) -> None:
    from flashvlm.engine.async_engine import AsyncEngine, EngineDeadError
    from flashvlm.server.budget import BudgetSteering

    llm = make_llm(tiny_ckpt, max_num_seqs=4, max_num_batched_tokens=512)
    controller = _FixedBudget(budget=10**6)  # above the configured budget: must be clamped to it
    engine = AsyncEngine(llm, on_step=BudgetSteering(llm.engine, controller).after_step)

    async def run(tier: str) -> int:
        outs = [o async for o in engine.generate({"prompt": "Hello there"},
                                                 SamplingParams(max_tokens=4, ignore_eos=True), tier=tier)]
        return len(outs[-1].token_ids)

    groups: list[str | None] = []
    add = llm.engine.add_processed

    def spy(*args: Any, **kwargs: Any) -> Any:
        req = add(*args, **kwargs)
        groups.append(req.group)
        return req

    llm.engine.add_processed = spy  # type: ignore[method-assign]
    assert asyncio.run(run("gold")) == 4
    assert groups == ["gold"]  # the tier reaches the scheduler, whose per-group caps use it
    assert llm.engine.token_budget == 512
    controller.budget = 8
    assert asyncio.run(run("gold")) == 4
    assert llm.engine.token_budget == 8 and engine.stats()["token_budget"] == 8
    assert llm.engine.config.scheduler.max_num_batched_tokens == 512  # the validated config is never written
    assert any(n >= 1 and tiers == {"gold"} for _, n, tiers in controller.calls)  # decode steps, running tier
    engine.shutdown()
    assert not engine.is_alive
    with pytest.raises(EngineDeadError):
        asyncio.run(run("gold"))
