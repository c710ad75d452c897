"""The request fields that constrain the output (structured outputs), on chat and completions alike: OpenAI's
`response_format` and vLLM's `structured_outputs` object with its older `guided_*` extras. At most one may be
given; `structured_spec()` turns it into the engine's StructuredOutputsParams (a bad shape is a 400 naming the
field; the engine's compile names a bad schema, regex or grammar)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from flashvlm.request import InvalidRequestError
from flashvlm.server.errors import bad_request
from flashvlm.structured.params import StructuredOutputsParams

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = Field(None, description="accepted (OpenAI requires it) and not used")
    description: str | None = Field(None, description="accepted and not used")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON Schema the output follows")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "text"
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputFields(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI: {type: text | json_object | json_schema, json_schema: {name, schema, strict}}")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM: exactly one of json (a schema), json_object, regex, choice, grammar (EBNF)")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older spelling of structured_outputs")
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The constraint the request asks for; None without one (or response_format text)."""
        given: dict[str, dict[str, Any]] = {}
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given["response_format"] = self._response_format(rf)
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given[name] = {key: value}
        if not given:
            return None
        if len(given) > 1:
            raise bad_request(f"give one output constraint, not several: {sorted(given)}", sorted(given)[1])
        [(param, spec)] = given.items()
        try:
            return StructuredOutputsParams.from_dict(spec)
        except (InvalidRequestError, TypeError) as e:
            raise bad_request(f"{param}: {e}", param) from None

    @staticmethod
    def _response_format(rf: ResponseFormat) -> dict[str, Any]:
        if rf.type == "json_object":
            return {"json_object": True}
        if rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            return {"json": rf.json_schema.schema_}
        raise bad_request(f"response_format type {rf.type!r} is not supported; one of {list(RESPONSE_FORMAT_TYPES)}",
                          "response_format")
