"""A chat request's tools and tool_choice: what the server makes of each combination, and the 400s."""

from __future__ import annotations

import pytest

from flashvlm.server.errors import APIError
from flashvlm.server.tool_protocol import NamedToolChoice, ToolDefinition, tool_mode


def _tools(*names: str) -> list[ToolDefinition]:
    return [ToolDefinition.model_validate({"type": "function", "function": {"name": n, "parameters": {}}})
            for n in names]


def test_modes() -> None:
    assert tool_mode(None, None, "hermes").choice == "off"
    auto = tool_mode(_tools("a", "b"), None, "hermes")
    assert auto.choice == "auto" and auto.renders_tools and auto.parses_calls
    assert [t["function"]["name"] for t in auto.tools] == ["a", "b"]
    none = tool_mode(_tools("a"), "none", "hermes")
    assert not none.renders_tools and not none.parses_calls
    named = tool_mode(_tools("a", "b"), NamedToolChoice.model_validate({"function": {"name": "b"}}), "hermes")
    assert (named.choice, named.function, named.renders_tools, named.parses_calls) == ("named", "b", True, False)
    assert tool_mode(_tools("a"), "required", "hermes").choice == "required"


@pytest.mark.parametrize(("tools", "choice", "parser", "field"), [
    (None, "auto", "hermes", "tool_choice"),
    (None, "none", "hermes", "tool_choice"),
    (["a"], None, "none", "tools"),
    (["a", "a"], None, "hermes", "tools"),
    (["a"], {"function": {"name": "missing"}}, "hermes", "tool_choice"),
])
def test_refused(tools: list[str] | None, choice: object, parser: str, field: str) -> None:
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    with pytest.raises(APIError) as e:
        tool_mode(None if tools is None else _tools(*tools), choice, parser)  # type: ignore[arg-type]
    assert e.value.status == 400 and e.value.param == field


def test_forced_call_schemas() -> None:
    named = tool_mode(_tools("a", "b"), NamedToolChoice.model_validate({"function": {"name": "b"}}), "hermes")
    assert named.forces_call and named.forced_call_schema() == {"type": "object"}  # no parameters: any object
    required = tool_mode(_tools("a", "b"), "required", "hermes", parallel=False).forced_call_schema()
    assert required["minItems"] == required["maxItems"] == 1
    assert [o["properties"]["name"] for o in required["items"]["anyOf"]] == [{"const": "a"}, {"const": "b"}]
    assert "maxItems" not in tool_mode(_tools("a"), "required", "hermes").forced_call_schema()
