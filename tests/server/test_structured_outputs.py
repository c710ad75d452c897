"""Structured outputs over HTTP: OpenAI's response_format (json_object, json_schema) and vLLM's structured_outputs
and guided_* extras on chat and completions, streamed and not; a bad schema, regex or grammar is a 400 naming it
while other requests carry on; and 100 random schemas with an image through the official `openai` client against
a real `flashvlm serve` all give schema-valid JSON."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from flashvlm.testing.random_schemas import random_schemas
from tests.server.conftest import MODEL, LiveServer, data_uri, image_message, png_bytes
from tests.server.serve_process import serve

pytest.importorskip("xgrammar")

CHAT = "/chat/completions"
COMPLETIONS = "/completions"
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 6},
                                           "priority": {"enum": ["low", "high"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["title", "priority", "count"], "additionalProperties": False}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Fill in the ticket"}], "max_tokens": 150,
            "temperature": 0, **fields}


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.v1 + path, json=body, timeout=60)


def _content(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_openai_client_response_formats(live: LiveServer) -> None:
    client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0)
    messages = image_message("Fill in the ticket", data_uri(png_bytes(seed=4)))
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=150, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "ticket", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=150, temperature=0.9, seed=2,
                                         response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop" and isinstance(json.loads(out.choices[0].message.content), dict)
    text = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                          response_format={"type": "text"})
    assert text.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("fields", "check"), [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]?'}}, lambda t: re.fullmatch("x[0-9]{1,2}", t)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_regex": "(ab|cd){1,3}!"}, lambda t: re.fullmatch("(ab|cd){1,3}!", t)),
    ({"guided_choice": ["one", "two"]}, lambda t: t in ("one", "two")),
    ({"guided_grammar": 'root ::= "[" [01] [01]? "]"'}, lambda t: re.fullmatch(r"\[[01]{1,2}\]", t)),
], ids=["regex", "choice", "json", "grammar", "response_format_json_schema", "guided_json",
        "guided_regex", "guided_choice", "guided_grammar"])
def test_vllm_fields_on_chat_and_completions(live: LiveServer, fields: dict, check: Any) -> None:
    assert check(_content(_post(live, CHAT, _chat(**fields))))
    body = {"model": MODEL, "prompt": "Ticket:", "max_tokens": 150, "temperature": 0.8, "seed": 5, **fields}
    assert check(_content(_post(live, COMPLETIONS, body)))


def test_streamed_json_schema(live: LiveServer) -> None:
    body = _chat(stream=True, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    with httpx.stream("POST", live.v1 + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "frob"}}}}, None,
     "JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"structured_outputs": {"regex": "(unclosed"}}, None, "regex"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, None, "grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "regexp"),
    ({"guided_json": "{broken"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, None, "not several"),
], ids=["bad-schema", "no-schema", "unknown-type", "bad-regex", "bad-grammar", "empty-choice", "unknown-key",
        "unparsable-guided-json", "two-constraints"])
def test_a_bad_constraint_is_a_400_naming_it(live: LiveServer, fields: dict, param: str | None, words: str) -> None:
    with ThreadPoolExecutor(2) as pool:  # a good request in flight alongside is served as usual
        good = pool.submit(_post, live, CHAT, _chat(max_tokens=4, ignore_eos=True))
        bad = _post(live, CHAT, _chat(**fields))
        assert good.result().status_code == 200
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param
    live.wait_idle()


@pytest.mark.slow
def test_100_random_schemas_with_an_image_through_flashvlm_serve(tiny_ckpt: Any) -> None:
    server = serve(tiny_ckpt, "--max-model-len", "1024", "--kv-cache-tokens", "16384")
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0, timeout=120)
        schemas = random_schemas(100, seed=21)

        def ask(k: int) -> tuple[dict, Any]:
            out = client.chat.completions.create(
                model="m", messages=image_message(f"Fill in form {k}", data_uri(png_bytes(seed=k))),
                max_tokens=600, temperature=0.0 if k % 2 else 1.0, seed=k,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": f"form{k}", "schema": schemas[k], "strict": True}})
            return schemas[k], out.choices[0]

        with ThreadPoolExecutor(8) as pool:
            for schema, choice in pool.map(ask, range(len(schemas))):
                assert choice.finish_reason == "stop", (schema, choice.message.content)
                jsonschema.validate(json.loads(choice.message.content), schema)
    finally:
        server.stop()


def test_a_slow_compile_holds_up_no_plain_request(live: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # Two compiles that cannot finish (blocked on an event) would hold both preprocessing threads if they ran
    # there; a plain request sent meanwhile is served, and only then are the compiles released.
    import threading

    structured = live.engine.engine.structured
    release, entered = threading.Event(), threading.Semaphore(0)
    check = structured.check

    def blocked_check(spec: Any) -> None:
        if spec is not None and threading.current_thread().name.startswith("flashvlm-grammar"):
            entered.release()
            assert release.wait(60)
        check(spec)

    monkeypatch.setattr(structured, "check", blocked_check)
    with ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(_post, live, CHAT, _chat(guided_choice=["a", f"b{i}"])) for i in range(2)]
        assert entered.acquire(timeout=30)
        plain = _post(live, CHAT, _chat(max_tokens=3, ignore_eos=True))
        assert plain.status_code == 200 and not any(f.done() for f in slow)
        release.set()
        assert all(_content(f.result()) in ("a", "b0", "b1") for f in slow)
    live.wait_idle()
