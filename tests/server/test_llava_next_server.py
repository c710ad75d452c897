"""The server over a tiny LLaVA-NeXT: a chat completion with pictures of two aspects gives what `LLM.chat` gives
(the templated prompt with the tokenizer's <s>, each picture's own token count), and a picture the tile
processor refuses is a 400 for that request only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flashvlm import SamplingParams
from flashvlm.testing.tiny_checkpoints import build_llava_next
from tests.server.conftest import MODEL, LiveServer, data_uri, image_message, make_llm, png_bytes, start_server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def next_server(tmp_path_factory: pytest.TempPathFactory, media_dir: Path) -> Iterator[tuple[LiveServer, object]]:
    ckpt = build_llava_next(tmp_path_factory.mktemp("llava-next-server"), seed=9)
    server = start_server(make_llm(ckpt), media_dir)
    yield server, make_llm(ckpt)
    server.stop()


def test_chat_completion_matches_llm_chat(next_server) -> None:
    live, llm = next_server
    messages = image_message("Which is wider?", data_uri(png_bytes(120, 40, seed=1)), data_uri(png_bytes(40, 90, 2)))
    r = httpx.post(live.base_url + CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 6,
                                               "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    body = r.json()
    assert body["choices"][0]["message"]["content"] == want.text
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert want.prompt_token_ids[0] == llm.engine.input_processor.tokenizer.bos_token_id
    items = llm.engine.process_chat(messages).mm_items
    assert items[0].num_tokens != items[1].num_tokens  # each aspect its own count


def test_a_refused_picture_is_a_400_and_the_server_goes_on(next_server) -> None:
    live, _ = next_server
    sliver = image_message("What is it?", data_uri(png_bytes(1, 300, seed=3)))  # aspect ratio 300
    r = httpx.post(live.base_url + CHAT, json={"model": MODEL, "messages": sliver, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "aspect ratio" in r.text
    ok = image_message("What is it?", data_uri(png_bytes(56, 56, seed=4)))
    assert httpx.post(live.base_url + CHAT, json={"model": MODEL, "messages": ok, "max_tokens": 2},
                      timeout=60).status_code == 200
    assert live.wait_idle()["num_free_blocks"] == live.wait_idle()["num_usable_blocks"]
