"""Tool calls in a model's output, in the format Qwen2.5, Qwen2.5-VL and Qwen3-VL are trained on (Hermes'):
each call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, after
any free text. vLLM users know this parser as `hermes`.

`ToolCallStream` reads an output as it streams, holding back only what could still turn into a tag;
`parse_tool_calls` reads a whole one the same way. A block whose JSON does not parse, or lacks a string `name`,
stays content: the client sees what the model wrote rather than a call it did not make.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "none")
"""`flashvlm serve --tool-call-parser` values: the output format read into `tool_calls`, or none (tools are
refused)."""

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as a JSON text, as OpenAI's `function.arguments` carries them."""
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tool_call_from_json(text: str) -> ToolCall | None:
    """The call a tag's body names, or None when it is not a JSON object with a string `name`."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: the text around the calls (None when blank) and the calls. It reads
    the output exactly as ToolCallStream does, so a streamed and a collected response agree."""
    stream = ToolCallStream()
    first, rest = stream.feed(text), stream.finish()
    content = (first.content + rest.content).strip()
    return content or None, first.calls + rest.calls


@dataclass
class StreamDelta:
    """What one piece of a streamed output adds: content text, calls completed by it, or both."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class ToolCallStream:
    """Splits a streamed output into content deltas and completed tool calls. A call is sent whole, when its
    closing tag arrives (OpenAI's stream format lets a call's arguments come in one delta). Text that cannot
    be the start of a tag is sent at once; only a trailing partial `<tool_call` is held back."""

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False
        self._saw_call = False
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        self._pending += text
        out = StreamDelta()
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE_TAG)
                if end < 0:
                    return out
                self._emit_call(self._pending[:end], out)
                self._pending = self._pending[end + len(CLOSE_TAG):]
                self._in_call = False
                continue
            start = self._pending.find(OPEN_TAG)
            if start >= 0:
                self._emit_content(self._pending[:start], out)
                self._pending = self._pending[start + len(OPEN_TAG):]
                self._in_call = self._saw_call = True
                continue
            keep = _partial_tag_length(self._pending)
            self._emit_content(self._pending[:len(self._pending) - keep], out)
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def finish(self) -> StreamDelta:
        """The rest once the output has ended: a call cut off before its closing tag counts when its JSON is
        complete; anything else left is content."""
        out = StreamDelta()
        if self._in_call:
            call = tool_call_from_json(self._pending.strip())
            if call is not None:
                out.calls.append(call)
                self.num_calls += 1
            else:
                out.content = OPEN_TAG + self._pending
        else:
            self._emit_content(self._pending, out)
        self._pending, self._in_call = "", False
        return out

    def _emit_call(self, body: str, out: StreamDelta) -> None:
        call = tool_call_from_json(body.strip())
        if call is None:
            out.content += OPEN_TAG + body + CLOSE_TAG  # not a call after all: what the model wrote
            return
        out.calls.append(call)
        self.num_calls += 1

    def _emit_content(self, text: str, out: StreamDelta) -> None:
        if self._saw_call and not text.strip():
            return  # the newlines between and after calls are not content
        out.content += text


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of `text` that is a proper start of OPEN_TAG."""
    for n in range(min(len(text), len(OPEN_TAG) - 1), 0, -1):
        if OPEN_TAG.startswith(text[-n:]):
            return n
    return 0
