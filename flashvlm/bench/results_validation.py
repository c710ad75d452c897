"""results.json's schema check: results_schema.json through jsonschema where it is installed, else a small
validator for the keyword subset the schema uses, so a bare install still refuses to write a malformed file."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA_PATH", "ResultsValidationError", "validate_results", "load_results"]

SCHEMA_PATH = Path(__file__).with_name("results_schema.json")


class ResultsValidationError(ValueError):
    """results.json content does not match results_schema.json; the message lists where and why."""


@functools.lru_cache(maxsize=1)
def _schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def _where(path: Sequence[Any]) -> str:
    out = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return out or "<top level>"


_TYPES: dict[str, Any] = {
    # bool is an int subclass in Python but not a JSON number, hence the explicit exclusions.
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _fallback_errors(v: Any, s: Mapping[str, Any], root: Mapping[str, Any], path: list[Any]) -> list[str]:
    """A validator for the small keyword subset results_schema.json uses; jsonschema is a test-only dependency,
    and a benchmark run on a bare install should still refuse to write a malformed file."""
    if "$ref" in s:
        target: Any = root
        for part in s["$ref"].lstrip("#/").split("/"):
            target = target[part]
        return _fallback_errors(v, target, root, path)
    here = _where(path)
    types = s.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](v) for t in types):
            return [f"{here}: {v!r:.80} is not of type {', '.join(map(repr, types))}"]
    errs: list[str] = []
    if "enum" in s and v not in s["enum"]:
        errs.append(f"{here}: {v!r:.80} is not one of {s['enum']!r}")
    if "minimum" in s and _TYPES["number"](v) and v < s["minimum"]:
        errs.append(f"{here}: {v!r} is less than the minimum of {s['minimum']!r}")
    if "pattern" in s and isinstance(v, str) and not re.search(s["pattern"], v):
        errs.append(f"{here}: {v!r:.80} does not match {s['pattern']!r}")
    if isinstance(v, dict):
        errs += [f"{here}: {k!r} is a required property" for k in s.get("required", []) if k not in v]
        props, extra = s.get("properties", {}), s.get("additionalProperties", True)
        for k, item in v.items():
            if k in props:
                errs += _fallback_errors(item, props[k], root, [*path, k])
            elif extra is False:
                errs.append(f"{here}: additional property {k!r} is not allowed")
            elif isinstance(extra, dict):
                errs += _fallback_errors(item, extra, root, [*path, k])
    if isinstance(v, list) and "items" in s:
        for i, item in enumerate(v):
            errs += _fallback_errors(item, s["items"], root, [*path, i])
    return errs


def validate_results(obj: Any) -> None:
    """Raise ResultsValidationError listing (up to 10) schema violations, each with its JSON path."""
    schema = _schema()
    try:
        import jsonschema
    except ImportError:
        errors = _fallback_errors(obj, schema, schema, [])
    else:
        found = sorted(jsonschema.Draft202012Validator(schema).iter_errors(obj), key=lambda e: list(e.absolute_path))
        errors = [f"{_where(list(e.absolute_path))}: {e.message}" for e in found]
    if errors:
        shown = "\n  - ".join(errors[:10])
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise ResultsValidationError(f"results do not match {SCHEMA_PATH.name} ({len(errors)} problem(s)):"
                                     f"\n  - {shown}{more}")


def load_results(path: str | Path) -> dict[str, Any]:
    """Read and validate a results.json."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
        validate_results(obj)
    except json.JSONDecodeError as e:
        raise ResultsValidationError(f"{path} is not valid JSON: {e}") from None
    except ResultsValidationError as e:
        raise ResultsValidationError(f"{path}: {e}") from None
    return obj
