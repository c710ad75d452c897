"""The chat API's tool fields (`tools`, `tool_choice`, history `tool_calls`) as OpenAI defines them, and what a
request's combination of them asks of the server: a `ToolMode`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from flashvlm.server.errors import bad_request


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class HistoryFunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str = Field("", description="the call's arguments as a JSON text")


class HistoryToolCall(BaseModel):
    """An earlier assistant turn's call, sent back by the client in `messages`."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: HistoryFunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolMode:
    """What the server does with a request's tools: render them into the prompt, read calls out of the output,
    and whether the output must be a call (`required`, or `function` naming one)."""

    choice: Literal["off", "none", "auto", "required", "named"]
    function: str | None = None
    tools: tuple[dict[str, Any], ...] = ()
    parallel: bool = True
    """OpenAI's parallel_tool_calls: false holds `required` to one call."""

    @property
    def renders_tools(self) -> bool:
        return self.choice in ("auto", "required", "named")

    @property
    def parses_calls(self) -> bool:
        """Whether `<tool_call>` blocks are read out of free text (auto)."""
        return self.choice == "auto"

    @property
    def forces_call(self) -> bool:
        """Whether the output is constrained to be the call (named: its arguments; required: a list of calls)."""
        return self.choice in ("required", "named")

    def forced_call_schema(self) -> dict[str, Any]:
        """The JSON schema the output is held to when a call is forced: the named function's arguments object, or
        for `required` a non-empty list of `{"name": ..., "parameters": {...}}` over the tools (vLLM's shape)."""
        by_name = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}
        if self.choice == "named":
            return by_name[self.function]
        options = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                    "required": ["name", "parameters"], "additionalProperties": False}
                   for name, parameters in by_name.items()]
        bound = {} if self.parallel else {"maxItems": 1}
        return {"type": "array", "minItems": 1, **bound, "items": {"anyOf": options}}


def tool_mode(tools: list[ToolDefinition] | None, tool_choice: ToolChoice | None, parser: str,
              parallel: bool = True) -> ToolMode:
    """The request's ToolMode; a 400 naming the field for a combination the server cannot honour."""
    if not tools:
        if tool_choice is not None:
            raise bad_request("tool_choice is only allowed when tools are given", "tool_choice")
        return ToolMode("off")
    if parser == "none":
        raise bad_request("tool calling is off on this server (started with --tool-call-parser none)", "tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"tools name the same function twice: {names}", "tools")
    dumped = tuple(t.model_dump(exclude_none=True) for t in tools)
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise bad_request(f"tool_choice names the function {tool_choice.function.name!r}, which is not in "
                              f"tools ({', '.join(names)})", "tool_choice")
        return ToolMode("named", tool_choice.function.name, dumped, parallel)
    choice = tool_choice or "auto"
    return ToolMode(choice, None, dumped, parallel)
