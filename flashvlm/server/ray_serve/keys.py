"""Routing keys of one request, read from its JSON body before any replica sees it.

- Image keys: one 64-bit XXH3 hash per distinct image, over the image's `url` string as the client sent it (for a
  data URI, its base64 bytes: the file's content). The engine's own cache key (processing/hashing.py) is over the
  decoded pixels; decoding here would cost the ingress what the replica does anyway, so the router's key is over
  the encoded file: the same file always shares a key, the same picture re-encoded does not.
- Prefix keys: the prompt laid out as text (each message as its role and content, each image as its key), cut into
  blocks of `block_chars`; key i hashes blocks 0..i, so two requests share key i exactly when their first i + 1
  blocks are equal (the engine's KV prefix cache works the same way on token blocks). A conversation's next turn
  repeats the earlier turns, so it shares their keys.

A body that does not parse yields no keys: the request goes to the least-loaded replica, which answers its 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash

ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions")


@dataclass(frozen=True)
class RoutingKeys:
    prefix: tuple[int, ...] = ()
    """One key per complete block of the prompt text, in order (key i covers blocks 0..i)."""
    images: tuple[int, ...] = ()
    """One key per distinct image, in order of first appearance."""

    @property
    def empty(self) -> bool:
        return not self.prefix and not self.images


NO_KEYS = RoutingKeys()


def routing_keys(path: str, body: bytes, block_chars: int) -> RoutingKeys:
    """The keys of a POST to `path` with this body (NO_KEYS for other routes and unreadable bodies)."""
    if path not in ROUTED_PATHS or not body:
        return NO_KEYS
    try:  # a body nested too deep for the parser (RecursionError) routes like any unreadable one
        payload = json.loads(body)
        if not isinstance(payload, dict):
            return NO_KEYS
        images: list[int] = []
        if path == "/v1/chat/completions":
            text = _chat_text(payload.get("messages"), images)
        else:
            prompt = payload.get("prompt")
            text = prompt if isinstance(prompt, str) else json.dumps(prompt, separators=(",", ":"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return NO_KEYS
    return RoutingKeys(prefix=_block_keys(text, block_chars), images=tuple(dict.fromkeys(images)))


def _chat_text(messages: Any, images: list[int]) -> str:
    if not isinstance(messages, list):
        return ""
    out: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        # Control characters mark the structure, so that no message text can imitate a role boundary.
        out.append(f"\x1e{message.get('role')}\x1f")
        content = message.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            for part in content:
                out.append(_part_text(part, images))
        elif content is not None:
            out.append(json.dumps(content, sort_keys=True, separators=(",", ":")))
    return "".join(out)


def _part_text(part: Any, images: list[int]) -> str:
    if not isinstance(part, dict):
        return ""
    if part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if part.get("type") == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if isinstance(url, str):
            key = xxhash.xxh3_64_intdigest(url.encode("utf-8", "surrogatepass"))
            images.append(key)
            return f"\x1d{key:016x}\x1d"
    return json.dumps(part, sort_keys=True, separators=(",", ":"))


def _block_keys(text: str, block_chars: int) -> tuple[int, ...]:
    h = xxhash.xxh3_64()
    keys: list[int] = []
    for start in range(0, len(text) - block_chars + 1, block_chars):
        h.update(text[start:start + block_chars].encode("utf-8", "surrogatepass"))
        keys.append(h.intdigest())
    return tuple(keys)
