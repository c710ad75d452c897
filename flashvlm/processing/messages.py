"""OpenAI-style chat messages as chat templates read them: image parts reduced to `{"type": "image"}` with
their sources collected in order, tool-call fields kept, every string checked for text a tokenizer cannot
encode."""

from __future__ import annotations

import json
import re
from typing import Any

from flashvlm.request import InvalidRequestError

_IMAGE_PART_TYPES = ("image", "image_url", "input_image")
_VIDEO_PART_TYPES = ("video", "video_url")
_TOOL_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name")
"""Message fields the chat template (or processing.tool_prompt) reads besides role and content."""


def normalize_messages(messages: Any) -> tuple[list[dict], list[Any], list[Any]]:
    """Messages with image and video parts reduced to {"type": "image"} / {"type": "video"} (what chat templates
    test for), and the image and the video sources in order of appearance."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out, images, videos = [], [], []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg or ("content" not in msg and "tool_calls" not in msg):
            raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'")
        content = msg.get("content")
        extra = {k: msg[k] for k in _TOOL_MESSAGE_FIELDS if msg.get(k) is not None}
        if extra:
            check_unicode(json.dumps(extra, ensure_ascii=False), f"messages[{i}]")
        if isinstance(content, str) or content is None:
            check_unicode(content or "", f"messages[{i}].content")
            out.append({"role": msg["role"], "content": content or "", **extra})
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}]: text part needs a 'text' string")
                check_unicode(part["text"], f"messages[{i}].content[{j}].text")
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _IMAGE_PART_TYPES:
                images.append(_image_source(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "image"})
            elif kind in _VIDEO_PART_TYPES:
                videos.append(_video_source(part, f"messages[{i}].content[{j}]"))
                parts.append({"type": "video"})
            else:
                raise InvalidRequestError(f"messages[{i}].content[{j}]: unsupported content part type "
                                          f"{kind!r} (supported: text, image_url, image, video_url, video)")
        out.append({"role": msg["role"], "content": parts, **extra})
    return out, images, videos


def _video_source(part: dict, where: str) -> Any:
    return _part_source(part, where, "video")


def _image_source(part: dict, where: str) -> Any:
    src = _part_source(part, where, "image", fallback_key="image_url")
    if isinstance(src, str) and part.get("type") == "image_url" and src.startswith(("http://", "https://")):
        raise InvalidRequestError(f"{where}: http(s) image URLs are not fetched; send a data URI")
    return src


def _part_source(part: dict, where: str, kind: str, fallback_key: str | None = None) -> Any:
    """The source a `{kind}_url` part names (its url: a data URI or a file path) or a `{kind}` part holds."""
    if part.get("type") == f"{kind}_url":
        url = part.get(f"{kind}_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{where}: {kind}_url part needs {kind}_url.url (a data URI or a file path)")
        return url
    src = part.get(kind, part.get(fallback_key) if fallback_key else None)
    if src is None:
        raise InvalidRequestError(f"{where}: {kind} part has no '{kind}'")
    return src


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_unicode(text: str, where: str) -> None:
    """Refuse a lone UTF-16 surrogate (JSON's "\\ud800" escape without its pair): it is no Unicode character, has
    no UTF-8 encoding and so no tokens. Replacing it would silently change the prompt, so it is refused."""
    found = _SURROGATE.search(text)
    if found is not None:
        raise InvalidRequestError(f"{where} holds a lone UTF-16 surrogate (U+{ord(found.group()):04X} at character "
                                  f"{found.start()}), which is not valid Unicode text; send valid UTF-8")
