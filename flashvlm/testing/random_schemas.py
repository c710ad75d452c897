"""Small random JSON schemas whose languages are finite (bounded strings, integers, arrays; closed objects), so
that even a random tiny model, constrained to one, ends within a known number of tokens. For the structured-output
tests: every output must parse and validate against its schema."""

from __future__ import annotations

import random
from typing import Any

MAX_STRING_CHARS = 4
MAX_ITEMS = 2
MAX_PROPERTIES = 3
MAX_DEPTH = 2


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "boolean", "enum", "null", "const"])
    if kind == "string":
        schema: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, MAX_STRING_CHARS)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        return schema
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 900)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "open", "closed", 1, 2, True, None], rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(["ok", 7, False])}
    return {"type": kind}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    r = rng.random()
    if depth < MAX_DEPTH and r < 0.2:
        return random_object(rng, depth + 1)
    if depth < MAX_DEPTH and r < 0.35:
        return {"type": "array", "items": _leaf(rng), "maxItems": rng.randint(0, MAX_ITEMS)}
    return _leaf(rng)


def random_object(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A closed object of 1..MAX_PROPERTIES properties (a random subset required), nested up to MAX_DEPTH."""
    names = rng.sample(["id", "name", "kind", "size", "tags", "ok", "note", "level"], rng.randint(1, MAX_PROPERTIES))
    props = {n: _value(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def random_schemas(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_object(rng) for _ in range(count)]
