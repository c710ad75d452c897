"""Tools and tool-call history in a chat prompt.

A chat template that knows tools (it reads the `tools` variable, as Qwen2.5's and Qwen3-VL's do) gets them as
they are, with each history call's `arguments` decoded from OpenAI's JSON text into an object, which is what
those templates print. A template that does not (Qwen2-VL's, Qwen2.5-VL's, LLaVA's) would drop them silently,
so the messages are rewritten into the Hermes convention those Qwen models were tuned on: the function
signatures in the system message, earlier calls as `<tool_call>` blocks in the assistant's text, and tool
results as `<tool_response>` blocks in a user turn.
"""

from __future__ import annotations

import json
from typing import Any

from flashvlm.request import InvalidRequestError

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>"
    "\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


def template_reads_tools(template: str) -> bool:
    return "tools" in template


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI `tools`: a list of {"type": "function", "function": {"name": ..., ...}}."""
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               template: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render with `template`: tools stay separate for a template that reads them, and are
    folded into the messages for one that does not."""
    if template_reads_tools(template):
        return [_decoded_call_arguments(m) for m in messages], tools
    rewritten = _hermes_history(messages)
    if tools:
        rewritten = _with_signatures(rewritten, tools)
    return rewritten, None


def _decoded_call_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    return {**message, "tool_calls": [_call_with_object_arguments(c, i) for i, c in enumerate(calls)]}


def _call_with_object_arguments(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"tool_calls[{index}] must have a function with a name")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise InvalidRequestError(f"tool_calls[{index}].function.arguments is not JSON: {e}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _hermes_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{_text_of(message.get('content'), i)}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = [_call_with_object_arguments(c, i) for i, c in enumerate(message["tool_calls"])]
            text = _text_of(message.get("content"), i)
            blocks = [json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                 ensure_ascii=False) for c in calls]
            text += "".join(f"\n<tool_call>\n{b}\n</tool_call>" for b in blocks)
            out.append({"role": "assistant", "content": text.lstrip("\n")})
            continue
        out.append({k: v for k, v in message.items() if k != "tool_calls"})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def _with_signatures(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    preamble = _TOOLS_PREAMBLE.format(signatures=signatures)
    if messages and messages[0].get("role") in ("system", "developer") and isinstance(messages[0]["content"], str):
        first = {**messages[0], "content": (messages[0]["content"] + "\n\n" + preamble).lstrip("\n")}
        return [first, *messages[1:]]
    return [{"role": "system", "content": preamble}, *messages]


def _text_of(content: Any, index: int) -> str:
    """The text of message `index`'s content: a string, or a list of text parts. Its images would lose their place
    in this convention, so they are refused (before any image is decoded)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"messages[{index}]: a tool message's or tool-calling assistant turn's content must be "
                              "text (a string or text parts) for this model's chat template")
