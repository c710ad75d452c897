"""A chat completion's text as the assistant message OpenAI's clients read: plain content, or content and
`tool_calls` when the request's tools let the model call them (server/tool_calls.py reads the calls)."""

from __future__ import annotations

from typing import Any

from flashvlm.server.protocol import AssistantMessage
from flashvlm.server.tool_calls import ToolCallStream, parse_tool_calls
from flashvlm.server.tool_protocol import ToolMode


def assistant_message(text: str, mode: ToolMode) -> AssistantMessage:
    if not mode.parses_calls:
        return AssistantMessage(content=text)
    content, calls = parse_tool_calls(text)
    return AssistantMessage(content=content, tool_calls=[c.to_openai() for c in calls])


def chat_finish_reason(reason: str, message_has_calls: bool) -> str:
    """OpenAI's `tool_calls` for an answer that ended by calling tools, else the engine's reason."""
    return "tool_calls" if message_has_calls and reason == "stop" else reason


class ChatDeltas:
    """One choice's stream: each text delta as the `delta` objects to send (content, then any completed calls,
    each with its index among the choice's calls)."""

    def __init__(self, mode: ToolMode) -> None:
        self._calls = ToolCallStream() if mode.parses_calls else None

    @property
    def num_calls(self) -> int:
        return 0 if self._calls is None else self._calls.num_calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self._calls is None:
            return [{"content": text}]
        return self._deltas(self._calls.feed(text), self._calls.num_calls)

    def finish(self) -> list[dict[str, Any]]:
        """What is left when the choice ends (a partial tag, a call cut off before its closing tag)."""
        if self._calls is None:
            return []
        return self._deltas(self._calls.finish(), self._calls.num_calls)

    @staticmethod
    def _deltas(delta: Any, num_calls: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"content": delta.content}] if delta.content else []
        first = num_calls - len(delta.calls)
        out += [{"tool_calls": [call.to_openai(index=first + k)]} for k, call in enumerate(delta.calls)]
        return out
