"""What a request constrains its output to (SamplingParams.structured_outputs), as vLLM spells it.

Exactly one of the fields is set. Nothing here needs the grammar engine: the constraint is checked for shape when
the request's SamplingParams are validated, and compiled (schema, regex and grammar errors found) by the engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from flashvlm.request import InvalidRequestError

MAX_CHOICES = 1024
"""Most alternatives one `choice` constraint may list."""
MAX_CONSTRAINT_CHARS = 1 << 20
"""Longest schema (as JSON), regex or grammar accepted: compiling is per request and runs on the host."""
MAX_SCHEMA_PROPERTIES = 512
"""Object properties a JSON schema may declare in all (nested ones count): xgrammar's compile time grows faster
than their number (600 bounded-string properties take about 0.5 s on a 2-core host, 3,000 over a minute), and a
compile holds up the other constrained requests."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict | str | None = None
    """A JSON Schema (a dict, or its JSON text): the output is one JSON value valid under it."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: tuple[str, ...] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar in EBNF / GBNF (a `root` rule), as xgrammar reads it."""

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        self.validate()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StructuredOutputsParams:
        """From the keys of vLLM's `structured_outputs` object; an unknown key is refused, naming it."""
        if not isinstance(data, dict):
            raise InvalidRequestError(f"structured_outputs must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"structured_outputs: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if v is not None})

    @property
    def kind(self) -> str:
        """The field that is set: json | json_object | regex | choice | grammar."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid structured_outputs: {msg}")

        set_fields = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_fields) != 1:
            raise bad(f"exactly one of json, json_object, regex, choice, grammar must be set, got {set_fields}")
        if not isinstance(self.json_object, bool):
            raise bad("json_object must be true or false")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    raise bad(f"json schema is not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise bad(f"json schema must be an object, got {type(schema).__name__}")
            if len(self.schema_text()) > MAX_CONSTRAINT_CHARS:
                raise bad(f"json schema is longer than {MAX_CONSTRAINT_CHARS} characters")
            num_properties = _count_properties(schema)
            if num_properties > MAX_SCHEMA_PROPERTIES:
                raise bad(f"json schema has {num_properties} properties; at most {MAX_SCHEMA_PROPERTIES} are "
                          "compiled (the grammar's compile time grows faster than the property count)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad(f"{name} must be a non-empty string")
            if value is not None and len(value) > MAX_CONSTRAINT_CHARS:
                raise bad(f"{name} is longer than {MAX_CONSTRAINT_CHARS} characters")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice or len(self.choice) > MAX_CHOICES:
                raise bad(f"choice must be a list of 1..{MAX_CHOICES} strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise bad("choice must be a list of non-empty strings")

    def schema_text(self) -> str:
        """The JSON schema as JSON text, keys in their given order: the output's properties follow it. Computed once
        (a schema may be a megabyte; the engine thread asks for it per sample)."""
        cached = self.__dict__.get("_schema_text")
        if cached is None:
            cached = json.dumps(json.loads(self.json) if isinstance(self.json, str) else self.json)
            self.__dict__["_schema_text"] = cached  # frozen: the memo bypasses __setattr__, as cached_property does
        return cached

    def cache_key(self) -> tuple[str, str]:
        """What identifies the compiled grammar: the kind and its text."""
        kind = self.kind
        text = {"json": self.schema_text, "json_object": lambda: "", "regex": lambda: self.regex,
                "choice": lambda: json.dumps(self.choice), "grammar": lambda: self.grammar}[kind]()
        return kind, text or ""


def _count_properties(schema: Any) -> int:
    """The `properties` entries of `schema` and of every schema nested in it."""
    count, stack = 0, [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                count += len(props)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return count
