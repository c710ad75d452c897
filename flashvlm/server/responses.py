"""Wire format of the OpenAI-compatible API's responses: completion objects, stream chunks, usage and the model
list (pydantic v2; requests in protocol.py)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from flashvlm.server.logprobs import ChatLogprobs, CompletionLogprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0
    image_tokens: int = 0
    """The prompt's image tokens as the vision tower yields them."""
    image_tokens_kept: int = 0
    """Of those, the tokens the model read (fewer with mm_token_pruning)."""


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


def usage(num_prompt: int, num_completion: int, num_cached: int, num_image: int = 0,
          num_image_kept: int = 0) -> UsageInfo:
    details = PromptTokensDetails(cached_tokens=num_cached, image_tokens=num_image, image_tokens_kept=num_image_kept)
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                     total_tokens=num_prompt + num_completion, prompt_tokens_details=details)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list, description="the calls read out of the output")


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None


class _CompletionObject(BaseModel):
    """The fields every completion object (response or stream chunk) opens with, in OpenAI's order; each kind
    pins `object` to its own literal."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletionResponse(_CompletionObject):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_CompletionObject):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# The chat stream's chunks, for the OpenAPI spec: the server writes them as plain dicts (serving.py).
class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_CompletionObject):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    """Required: every chunk of one stream carries the same creation time."""
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "flashvlm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
