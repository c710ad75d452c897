"""Log-probabilities in OpenAI's response shapes: chat's `logprobs.content[]` entries and the completions
endpoint's `logprobs` object (tokens, token_logprobs, top_logprobs, text_offset), from the engine's TokenLogprobs.

A token's text is the tokenizer's decoding of that one token (a byte-level piece of a multi-byte character
decodes to U+FFFD, as in vLLM); `bytes` are its UTF-8 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from flashvlm.request import MAX_LOGPROBS, TokenLogprobs
from flashvlm.server.errors import bad_request


def check_num_logprobs(value: int | None, param: str) -> None:
    """A request's count of top log-probabilities (chat top_logprobs, completions logprobs) is in range."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be an integer in [0, {MAX_LOGPROBS}], got {value}", param)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class LogprobsFormatter:
    """Turns TokenLogprobs into the response shapes, decoding each token id once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """A chat choice's `logprobs` for these tokens."""
        return {"content": [{**self._entry(e.token_id, e.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in e.top]} for e in entries]}

    def completion(self, entries: Sequence[TokenLogprobs], text_offset: int = 0) -> dict[str, Any]:
        """A completion choice's `logprobs` for these tokens; offsets count the token texts from `text_offset` (the
        characters of the tokens before them, in a stream)."""
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for text in tokens:
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.token_text(t): v for t, v in e.top} for e in entries],
                "text_offset": offsets}

    @staticmethod
    def text_length(completion_logprobs: dict[str, Any]) -> int:
        """Characters the tokens of a `completion()` result span (where the next chunk's offsets start)."""
        return sum(len(t) for t in completion_logprobs["tokens"])
