"""Tool calling through the official `openai` client against the live server: a model answer in Qwen's Hermes
format read into `tool_calls` (the tiny model is held to that exact answer by a `choice` constraint, so the text
is the model's own sampled tokens), a named function and `required` forcing calls valid under the tools' schemas,
streamed and not, and the history of an earlier call sent back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.conftest import MODEL, data_uri, image_message, make_llm, png_bytes, start_server

pytest.importorskip("xgrammar")

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": CITY, "get_time": CLOCK}
HERMES = ("I will look it up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n"
          "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>")


@pytest.fixture(scope="module")
def client(tiny_ckpt: Path, media_dir: Path) -> Iterator[openai.OpenAI]:
    # The tools' signatures make long prompts for the tiny byte-level tokenizer: a longer context than `live`'s.
    server = start_server(make_llm(tiny_ckpt, max_model_len=2048), media_dir)
    yield openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
    server.stop()


def _messages() -> list[dict[str, Any]]:
    return image_message("What is the weather where this was taken, and the time there?",
                         data_uri(png_bytes(seed=9)))


def _streamed(client: openai.OpenAI, **kw: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) reassembled from a stream's deltas."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_auto_reads_hermes_calls_out_of_the_answer(client: openai.OpenAI) -> None:
    kw = {"messages": _messages(), "tools": TOOLS, "max_tokens": 200, "temperature": 0,
          "extra_body": {"structured_outputs": {"choice": [HERMES]}}}
    out = client.chat.completions.create(model=MODEL, **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I will look it up."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    content, streamed, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and content.strip() == "I will look it up."
    assert [(n, json.loads(a)) for n, a in streamed] == calls


def test_without_tools_the_same_answer_is_plain_content(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=200, temperature=0,
                                         extra_body={"structured_outputs": {"choice": [HERMES]}})
    assert out.choices[0].message.content == HERMES and not out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "stop"
    none = client.chat.completions.create(model=MODEL, messages=_messages(), max_tokens=200, temperature=0,
                                          tools=TOOLS, tool_choice="none",
                                          extra_body={"structured_outputs": {"choice": [HERMES]}})
    assert none.choices[0].message.content == HERMES and not none.choices[0].message.tool_calls


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_named_function_is_called_with_schema_valid_arguments(client: openai.OpenAI, seed: int) -> None:
    kw = {"messages": _messages(), "tools": TOOLS, "max_tokens": 60, "temperature": 1.0, "seed": seed,
          "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    out = client.chat.completions.create(model=MODEL, **kw)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), CLOCK)
    _, streamed, finish = _streamed(client, **kw)
    assert finish == "tool_calls" and streamed == [("get_time", call.function.arguments)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_gives_a_valid_call(client: openai.OpenAI, seed: int) -> None:
    # parallel_tool_calls false bounds the list to one call: the random tiny model would go on listing calls.
    kw = {"messages": _messages(), "tools": TOOLS, "max_tokens": 120, "temperature": 1.0, "seed": seed,
          "tool_choice": "required", "parallel_tool_calls": False}
    out = client.chat.completions.create(model=MODEL, **kw)
    calls = out.choices[0].message.tool_calls
    assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    _, streamed, _ = _streamed(client, **kw)
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]


def test_history_with_a_call_and_its_result_is_served(client: openai.OpenAI) -> None:
    history = [*_messages(),
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "snow, -3 C"}]
    out = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > 0


def test_forced_calls_do_not_combine_with_another_constraint(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        client.chat.completions.create(model=MODEL, messages=_messages(), tools=TOOLS, tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=8)
