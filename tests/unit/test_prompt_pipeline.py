"""PromptPipeline gives the prompt the one-thread InputProcessor gives, with text and images on their own pools:
a text-only prompt never opens an image session, a bad image fails its request with its index and leaves no job
behind, and the budget counts arrays as well as encoded images."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flashvlm import LLM
from flashvlm.processing.prompt_pipeline import ImageBudget, ImageBudgetError, PromptPipeline
from flashvlm.request import InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PromptPipeline]:
    llm = LLM(str(build_qwen2_vl(tmp_path_factory.mktemp("pipeline-ckpt"), seed=3)), device="cpu", max_model_len=512,
              kv_cache_tokens=1024)
    pipe = PromptPipeline(llm.engine.input_processor, text_threads=1, image_threads=2, image_decodes_per_request=1)
    yield pipe
    pipe.shutdown()


def _png(seed: int, w: int = 56, h: int = 84) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _chat(*images: object) -> list[dict]:
    parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": "What is it?"}]
    return [{"role": "user", "content": parts}]


def test_same_prompt_as_the_one_thread_path(pipeline: PromptPipeline) -> None:
    messages = _chat(_png(1), _png(2, 112, 56), np.full((60, 40, 3), 7, np.uint8))
    ours = asyncio.run(pipeline.process_chat(messages))
    ref = pipeline.processor.process_chat(messages)
    assert ours.prompt_token_ids == ref.prompt_token_ids
    assert len(ours.mm_items) == 3
    for a, b in zip(ours.mm_items, ref.mm_items):
        assert (a.mm_hash, a.offset, a.num_tokens, a.layout) == (b.mm_hash, b.offset, b.num_tokens, b.layout)
        assert torch.equal(torch.as_tensor(a.pixel_values), torch.as_tensor(b.pixel_values))
    prompt = asyncio.run(pipeline.process({"prompt": "<|vision_start|><|image_pad|><|vision_end|>hi",
                                           "images": [_png(1)]}))
    assert prompt.mm_items[0].mm_hash == ref.mm_items[0].mm_hash


def test_text_only_never_opens_an_image_session(pipeline: PromptPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("a text-only prompt asked the image pool")

    monkeypatch.setattr(pipeline.images, "session", refuse)
    out = asyncio.run(pipeline.process_chat([{"role": "user", "content": "hello"}]))
    assert out.prompt_token_ids and out.mm_items == []
    assert asyncio.run(pipeline.process("plain text")).mm_items == []


def test_a_bad_image_fails_its_request_and_leaves_no_job(pipeline: PromptPipeline) -> None:
    with pytest.raises(InvalidRequestError, match="image 2"):
        asyncio.run(pipeline.process_chat(_chat(_png(1), _png(2), b"not an image", _png(3), _png(4))))
    assert pipeline.images.stats()["image_jobs_waiting"] == 0  # cancelled; one already started may finish
    deadline = time.monotonic() + 30
    while pipeline.images.stats()["image_jobs_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    asyncio.run(pipeline.process_chat(_chat(_png(5))))  # the pool still serves


def test_the_budget_counts_arrays_and_encoded_images(pipeline: PromptPipeline) -> None:
    messages = _chat(_png(1), np.zeros((50, 40, 3), np.uint8))  # 56 x 84 + 40 x 50 pixels
    total = 56 * 84 + 40 * 50
    asyncio.run(pipeline.process_chat(messages, budget=ImageBudget(max_pixels=total)))
    with pytest.raises(ImageBudgetError, match=str(total)) as e:
        asyncio.run(pipeline.process_chat(messages, budget=ImageBudget(max_pixels=total - 1)))
    assert e.value.limit == "max_pixels"


def test_loader_sees_each_source_with_its_index(pipeline: PromptPipeline, tmp_path: Path) -> None:
    seen: list[tuple[str, int]] = []
    pics = {"a": _png(1), "b": _png(2)}

    def load(src: str, index: int) -> bytes:
        seen.append((src, index))
        return pics[src]

    out = asyncio.run(pipeline.process_chat(_chat("a", "b"), load=load))
    assert sorted(seen) == [("a", 0), ("b", 1)] and len(out.mm_items) == 2
