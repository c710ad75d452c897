"""A chat completion's text as the assistant message OpenAI's clients read: plain content, or content and
`tool_calls` when the request's tools let the model call them (server/tool_calls.py reads the calls)."""

from __future__ import annotations

import json
from typing import Any

from flashvlm.server.responses import AssistantMessage
from flashvlm.server.tool_calls import ToolCall, ToolCallStream, parse_tool_calls
from flashvlm.server.tool_protocol import ToolMode


def assistant_message(text: str, mode: ToolMode) -> AssistantMessage:
    if mode.forces_call:
        calls = forced_calls(text, mode)
        return AssistantMessage(content=None if calls else text, tool_calls=[c.to_openai() for c in calls])
    if not mode.parses_calls:
        return AssistantMessage(content=text)
    content, calls = parse_tool_calls(text)
    return AssistantMessage(content=content, tool_calls=[c.to_openai() for c in calls])


def forced_calls(text: str, mode: ToolMode) -> list[ToolCall]:
    """The calls of an output held to `mode.forced_call_schema()`: the named function with the output as its
    arguments (whole or, when max_tokens cut it, as far as it got: what the stream sent), or the listed calls for
    `required`, none when the list was cut off before it was whole (the text is then returned as content)."""
    if mode.choice == "named":
        return [ToolCall(mode.function or "", text)]
    try:
        value = json.loads(text)
    except ValueError:
        return []
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
    except (KeyError, TypeError):  # not the schema's shape: only when the engine ran without the constraint
        return []


def chat_finish_reason(reason: str, message_has_calls: bool) -> str:
    """OpenAI's `tool_calls` for an answer that ended by calling tools, else the engine's reason."""
    return "tool_calls" if message_has_calls and reason == "stop" else reason


class ChatDeltas:
    """One choice's stream: each text delta as the `delta` objects to send (content, then any completed calls,
    each with its index among the choice's calls)."""

    def __init__(self, mode: ToolMode) -> None:
        self._mode = mode
        self._calls = ToolCallStream() if mode.parses_calls else None
        self._named: ToolCall | None = ToolCall(mode.function, "") if mode.choice == "named" and mode.function else None
        self._forced_text = ""
        self._num_forced = 0

    @property
    def num_calls(self) -> int:
        return self._num_forced if self._calls is None else self._calls.num_calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._named is not None:  # the arguments stream as they come, after one delta naming the call
            head = [] if self._num_forced else [{"tool_calls": [self._named.to_openai(index=0)]}]
            self._num_forced = 1
            return head + [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}]
        if self._mode.forces_call:  # required: the list of calls is read whole when it ends
            self._forced_text += text
            return []
        if self._calls is None:
            return [{"content": text}]
        return self._deltas(self._calls.feed(text), self._calls.num_calls)

    def finish(self) -> list[dict[str, Any]]:
        """What is left when the choice ends (a partial tag, a call cut off before its closing tag, the calls of
        tool_choice required)."""
        if self._named is not None:
            return []
        if self._mode.forces_call:
            calls = forced_calls(self._forced_text, self._mode)
            self._num_forced = len(calls)
            if not calls:
                return [{"content": self._forced_text}] if self._forced_text else []
            return [{"tool_calls": [c.to_openai(index=k)]} for k, c in enumerate(calls)]
        if self._calls is None:
            return []
        return self._deltas(self._calls.finish(), self._calls.num_calls)

    @staticmethod
    def _deltas(delta: Any, num_calls: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"content": delta.content}] if delta.content else []
        first = num_calls - len(delta.calls)
        out += [{"tool_calls": [call.to_openai(index=first + k)]} for k, call in enumerate(delta.calls)]
        return out
