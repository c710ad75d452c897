"""Wire format of the OpenAI-compatible API's requests (pydantic v2; responses in responses.py, errors in
errors.py, log-probabilities in logprobs.py), and the mapping from a request to `SamplingParams`.

Unknown request fields are accepted and ignored (the OpenAI client sends fields we have no use for, such as
`store` or `metadata`); fields we recognise but cannot honour (`best_of` other than `n`, non-zero presence or frequency
penalties, `logit_bias`, `echo`, `suffix`) are refused with 400
rather than silently ignored, so a client never gets an answer computed differently from what it asked for.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, field_validator, model_validator

from flashvlm.request import MAX_LOGPROBS, MAX_NUM_SAMPLES, SamplingParams
from flashvlm.server.errors import APIError, ErrorInfo, ErrorResponse, bad_request  # noqa: F401 (re-exported)
from flashvlm.server.logprobs import check_num_logprobs
from flashvlm.server.structured_fields import StructuredOutputFields
from flashvlm.server.tool_protocol import HistoryToolCall, ToolChoice, ToolDefinition, ToolMode, tool_mode
from flashvlm.structured.params import StructuredOutputsParams

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The detokenizer searches every stop string after every token, so a request's stop strings cost the whole batch;
# these bounds are far beyond real use (OpenAI allows 4 strings) and keep that cost, and the stream holdback, small.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512


# ---- requests ----------------------------------------------------------------------------------
class _NullMeansDefault(BaseModel):
    """OpenAI marks most optional fields nullable and its clients send explicit nulls; a null here means the
    field's default, so `"n": null` is `n=1` (and does not count as set, e.g. for `priority`)."""

    NULL_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset()
    """Fields where null means something other than the default (completions' max_tokens: no limit)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or k in cls.NULL_IS_A_VALUE}
        return data


class _Request(_NullMeansDefault):
    # Extra fields are kept (not rejected) so newer OpenAI clients keep working; NaN and inf are never valid.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str = Field(description="data:image/...;base64,... URI; a file path or file:// URL under "
                                 "--allowed-local-media-path; http(s) only with --allow-remote-images")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted and ignored")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURLPart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    model_config = ConfigDict(extra="allow")
    url: str = Field(description="data:video/...;base64,... URI, or a file path or file:// URL under "
                                 "--allowed-local-media-path (Qwen-VL models only)")


class VideoURLPart(BaseModel):
    type: Literal["video_url"]
    video_url: VideoURL


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[HistoryToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")


class StreamOptions(_NullMeansDefault):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="accepted and ignored")


class _SamplingFields(_Request, StructuredOutputFields):
    """Fields shared by both endpoints; names and meanings as OpenAI's and vLLM's."""

    model: str | None = Field(None, description="must be one of the served model names (default: the first)")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=MAX_NUM_SAMPLES,
                         description=f"completions (choices) to generate, 1..{MAX_NUM_SAMPLES}; the prompt is "
                                     "computed once and shared")
    best_of: int | None = Field(None, description="vLLM's; only n (or left out): ranking samples is not supported")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float = Field(0.0, description="only 0 is supported")
    frequency_penalty: float = Field(0.0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, description="-1 or 0 disables")
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None  # strict: JSON true is not token 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX,
                          description="lower is served first; overrides the SLA tier's priority (the tier "
                                      "still labels the request's metrics)")
    # Echoed in the x-request-id header, so only visible ASCII (a newline would break the response head).
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    sla_tier: str | None = Field(None, description="SLA tier name (or the x-sla-tier header)")

    def common_checks(self) -> None:
        self.structured_spec()  # its shape, before any image is decoded (the engine compiles it later)
        if self.best_of not in (None, self.n):
            raise bad_request(f"best_of={self.best_of} is not supported (ranking best_of samples to return n): leave "
                              "it out or set it to n", "best_of")
        if self.presence_penalty != 0.0:
            raise bad_request("presence_penalty is not supported (only 0); use repetition_penalty", "presence_penalty")
        if self.frequency_penalty != 0.0:
            raise bad_request("frequency_penalty is not supported (only 0); use repetition_penalty",
                              "frequency_penalty")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request(f"{len(stops)} stop strings given; at most {MAX_STOP_STRINGS} stop strings are "
                              "allowed", "stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise bad_request(f"a stop string of {longest} characters given; each may have at most "
                              f"{MAX_STOP_STRING_CHARS} characters", "stop")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="return each output token's log-probability (raw logits)")
    top_logprobs: int | None = Field(None, description=f"0..{MAX_LOGPROBS} most likely tokens per position; "
                                                       "needs logprobs: true")
    tools: list[ToolDefinition] | None = Field(None, description="functions the model may call (docs/server.md)")
    tool_choice: ToolChoice | None = Field(None, description="none, auto (the default with tools), required, or "
                                                              "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    parallel_tool_calls: bool = Field(True, description="false: tool_choice required makes one call")
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="min_pixels / max_pixels (Qwen), mm_token_pruning / mm_token_keep_ratio / "
                          "mm_token_dedup_threshold (visual-token pruning); the engine checks each value (a bad one "
                          "is a 400 naming it)")

    _tool_mode: ToolMode = PrivateAttr(default_factory=lambda: ToolMode("off"))

    def check(self, tool_call_parser: str = "hermes") -> None:
        self._tool_mode = tool_mode(self.tools, self.tool_choice, tool_call_parser, self.parallel_tool_calls)
        self.common_checks()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        check_num_logprobs(self.top_logprobs, "top_logprobs")

    def structured_spec(self) -> StructuredOutputsParams | None:
        """The output constraint: the request's own, or a forced tool call's (tool_choice required or named),
        which cannot be combined with another."""
        spec = super().structured_spec()
        if not self._tool_mode.forces_call:
            return spec
        if spec is not None:
            raise bad_request("tool_choice required or a named function constrains the output itself; it cannot be "
                              "combined with response_format or structured_outputs", "tool_choice")
        return StructuredOutputsParams(json=self._tool_mode.forced_call_schema())

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_mode(self) -> ToolMode:
        """What the request's tools ask for, as check() resolved it."""
        return self._tool_mode

    def engine_messages(self) -> list[dict[str, Any]]:
        """Messages as the engine's chat processing takes them (developer = system, as OpenAI defines it)."""
        out = []
        for m in self.messages:
            role = "system" if m.role == "developer" else m.role
            if isinstance(m.content, list):
                content: Any = [p.model_dump(exclude_none=True) for p in m.content]
            else:
                content = m.content or ""
            message = {"role": role, "content": content}
            if m.tool_calls:
                message["tool_calls"] = [c.model_dump(exclude_none=True) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(message)
        return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="one prompt: text, or token ids (a list of one prompt is accepted too)")
    max_tokens: int | None = Field(16, ge=1, description="16 when left out; null: the rest of the context")
    NULL_IS_A_VALUE: ClassVar[frozenset[str]] = frozenset({"max_tokens"})  # as OpenAI and vLLM read it
    echo: bool = Field(False, description="not supported")
    suffix: str | None = Field(None, description="not supported")
    logprobs: int | None = Field(None, description=f"0..{MAX_LOGPROBS}: each token's log-probability and those "
                                                   "of the most likely tokens")

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_bool_token_ids(cls, prompt: Any) -> Any:
        # StrictInt already refuses JSON true / false as token ids 1 / 0; this only names the problem, where the
        # union's errors would talk about strings.
        if isinstance(prompt, list):
            items = [x for p in prompt for x in (p if isinstance(p, list) else [p])]
            if any(isinstance(x, bool) for x in items):
                raise ValueError("token ids must be integers, not true / false")
        return prompt

    def check(self) -> None:
        self.common_checks()
        check_num_logprobs(self.logprobs, "logprobs")
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def engine_prompt(self) -> dict[str, Any]:
        p = self.prompt
        if isinstance(p, list) and len(p) > 0 and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request(f"batched prompts ({len(p)}) are not supported; send one request per prompt",
                                  "prompt")
            p = p[0]
        if isinstance(p, str):
            return {"prompt": p}
        if not p:
            raise bad_request("the prompt is empty", "prompt")
        return {"prompt_token_ids": list(p)}


def to_sampling_params(req: ChatCompletionRequest | CompletionRequest, defaults: SamplingParams,
                       num_prompt_tokens: int, max_model_len: int,
                       kv_capacity_tokens: int | None = None) -> SamplingParams:
    """SamplingParams from the request over the model's defaults (generation_config.json), as vLLM does.
    Without max_tokens a request may use the rest of the context, or of the KV cache when that holds fewer
    tokens (`kv_capacity_tokens`; the engine refuses a request that could outgrow it). Raises APIError or
    InvalidRequestError on bad values."""
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise APIError(400, f"the prompt is {num_prompt_tokens} tokens long; max_model_len is {max_model_len} "
                       "(the prompt plus at least one generated token must fit)",
                       param=prompt_param, code="context_length_exceeded")
    # The last sampled token is never fed back, so it needs no KV: the cache bounds prompt + max_tokens - 1.
    kv_room = room if kv_capacity_tokens is None else kv_capacity_tokens + 1 - num_prompt_tokens
    if kv_room < 1:
        raise APIError(400, f"the prompt is {num_prompt_tokens} tokens long; the engine's KV cache holds "
                       f"{kv_capacity_tokens} tokens (the prompt plus at least one generated token must fit)",
                       param=prompt_param, code="context_length_exceeded")
    max_tokens = req.requested_max_tokens()
    if max_tokens is None:
        max_tokens = min(room, kv_room)
    elif max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                       f"{num_prompt_tokens} and max_tokens asks for {max_tokens} more", param="max_tokens",
                       code="context_length_exceeded")
    elif max_tokens > kv_room:
        raise APIError(400, f"the engine's KV cache holds {kv_capacity_tokens} tokens; the prompt has "
                       f"{num_prompt_tokens} and max_tokens asks for {max_tokens} more (at most {kv_room} fit)",
                       param="max_tokens", code="context_length_exceeded")
    fields: dict[str, Any] = {"max_tokens": max_tokens, "min_tokens": req.min_tokens, "ignore_eos": req.ignore_eos,
                              "skip_special_tokens": req.skip_special_tokens, "seed": req.seed,
                              "logprobs": req.requested_logprobs(), "n": req.n,
                              "structured_outputs": req.structured_spec()}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    if req.stop is not None:
        fields["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids is not None:
        fields["stop_token_ids"] = list(req.stop_token_ids)
    return dataclasses.replace(defaults, **fields)  # replace() re-runs validation in __post_init__
