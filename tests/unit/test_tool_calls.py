"""Tool calls read out of a model's text (whole and streamed) and tools rendered into chat prompts."""

from __future__ import annotations

import json
import random

import pytest

from flashvlm.processing.tool_prompt import check_tools, with_tools
from flashvlm.request import InvalidRequestError
from flashvlm.server.tool_calls import ToolCallStream, parse_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def _call(name: str, **arguments: object) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_whole_output_with_text_and_two_calls() -> None:
    text = "Let me check.\n" + _call("get_weather", city="Paris") + "\n" + _call("get_time", zone="CET")
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                  ("get_time", {"zone": "CET"})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")


def test_plain_text_and_broken_calls_stay_content() -> None:
    assert parse_tool_calls("no tools here") == ("no tools here", [])
    broken = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>"  # one brace short
    assert parse_tool_calls(broken) == (broken, [])
    nameless = "<tool_call>{\"arguments\": {}}</tool_call>"
    assert parse_tool_calls(nameless) == (nameless, [])
    content, calls = parse_tool_calls(_call("good") + "\n" + nameless)
    assert content == nameless and [c.name for c in calls] == ["good"]


def test_a_call_cut_off_before_its_closing_tag_counts_when_its_json_is_whole() -> None:
    content, calls = parse_tool_calls("<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}")
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": [1, 2]})]
    text = "<tool_call>\n{\"name\": \"f\", \"argu"
    assert parse_tool_calls(text) == (text, [])


def test_string_arguments_pass_through() -> None:
    _, calls = parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>")
    assert calls[0].arguments == "{\"a\": 1}"


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    stream, content, calls = ToolCallStream(), "", []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        delta = stream.feed(text[start:end])
        content += delta.content
        calls += [(c.name, c.arguments) for c in delta.calls]
    rest = stream.finish()
    return content + rest.content, calls + [(c.name, c.arguments) for c in rest.calls]


@pytest.mark.parametrize("seed", range(20))
def test_streamed_in_random_pieces_equals_the_whole_parse(seed: int) -> None:
    rng = random.Random(seed)
    pieces = [rng.choice(["Sure. ", "a < b ", "<tool", "x\n"]) for _ in range(rng.randint(0, 3))]
    text = "".join(pieces) + "".join("\n" + _call(f"f{i}", i=i) for i in range(rng.randint(0, 3)))
    if rng.random() < 0.3:
        text += "\n<tool_call>{\"name\": \"broken\""  # cut off mid-JSON: content, in both readings
    text = text or "ok"
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    streamed_content, streamed_calls = _stream(text, cuts)
    content, calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == streamed_calls
    assert (content or "") == streamed_content.strip()
    assert len(calls) == text.count("<tool_call>\n{")  # the broken one is written without the newline


def test_stream_holds_back_only_a_possible_tag() -> None:
    stream = ToolCallStream()
    assert stream.feed("Hello <to").content == "Hello "
    assert stream.feed("day").content == "<today"
    delta = stream.feed(" done <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n")
    assert delta.content == " done " and [c.name for c in delta.calls] == ["f"]
    assert not stream.feed("\n\n") and not stream.finish()


def test_a_tool_aware_template_gets_tools_and_object_arguments() -> None:
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    messages, tools = with_tools(history, [WEATHER], "{% if tools %}{{ tools }}{% endif %}")
    assert tools == [WEATHER]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert history[1]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Paris\"}"  # not mutated


def _history_call(call_id: str, city: str) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


def test_a_template_without_tools_gets_the_hermes_convention() -> None:
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Weather in Paris and Rome?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   _history_call("a", "Paris"), _history_call("b", "Rome")]},
               {"role": "tool", "tool_call_id": "a", "content": "sunny"},
               {"role": "tool", "tool_call_id": "b", "content": [{"type": "text", "text": "rain"}]}]
    messages, tools = with_tools(history, [WEATHER], "{{ messages }}")
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in messages[0]["content"]
    content, calls = parse_tool_calls(messages[2]["content"])
    assert content is None and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert messages[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"


@pytest.mark.parametrize("tools", [{"a": 1}, [{"type": "function"}], [{"type": "function", "function": {}}],
                                   [{"type": "retrieval", "function": {"name": "f"}}],
                                   [{"type": "function", "function": {"name": "f", "parameters": [1]}}]])
def test_bad_tools_are_refused(tools: object) -> None:
    with pytest.raises(InvalidRequestError):
        check_tools(tools)


def test_bad_history_arguments_are_refused() -> None:
    history = [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]
    with pytest.raises(InvalidRequestError, match="arguments is not JSON"):
        with_tools(history, None, "{{ messages }}")


def test_images_in_tool_turns_are_refused_where_the_convention_has_no_place_for_them() -> None:
    history = [{"role": "user", "content": "Look"},
               {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "a chart:"},
                                                                  {"type": "image"}]}]
    with pytest.raises(InvalidRequestError, match=r"messages\[1\]: .* must be text"):
        with_tools(history, None, "{{ messages }}")
    messages, _ = with_tools(history, None, "{% for t in tools %}{% endfor %}")  # the template places them
    assert messages[1]["content"][1] == {"type": "image"}
