"""Incremental detokenization of one request's output, with stop strings.

Decoding token by token is wrong for two reasons: a character can span several tokens (byte-level
BPE, sentencepiece byte fallback), and decoders treat the first token of a sequence specially
(sentencepiece strips its leading space). So each step decodes a short window twice, the
already-emitted part of it (``prefix``) and the whole of it, and emits the difference. The window
starts at the last point where the text was complete, so its first token is always one whose text
was emitted before; special handling of that first token then cancels out in the difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# What decoders put for bytes that do not (yet) form a valid UTF-8 character.
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas.

    The concatenation of every delta returned by ``append`` and ``flush`` equals
    ``tokenizer.decode(output_ids, skip_special_tokens=...)`` (cut before the first stop string,
    if one occurs). Output text is decoded on its own, not as a continuation of the prompt, so it
    matches what transformers returns for the generated ids (no stray leading space from
    sentencepiece tokenizers). ``prompt_token_ids`` is kept for callers that want it but does not
    change the text.

    While stop strings are set, deltas hold back the last ``max(len(stop)) - 1`` characters, which
    could be the start of a stop string completed by a later token; ``flush`` releases them.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1

        # The Rust tokenizer's own decode when it gives what transformers' would (no post-decode space clean-up):
        # the Python wrapper costs several times the decode itself, twice per token of every running request.
        backend = getattr(tokenizer, "_tokenizer", None)
        self._fast_decode = (backend.decode if backend is not None and hasattr(backend, "decode")
                             and not getattr(tokenizer, "clean_up_tokenization_spaces", False) else None)
        self.token_ids: list[int] = []
        # Window bounds into token_ids: text of [prefix_offset, read_offset) has been decoded into
        # self._text; tokens from read_offset on are not yet part of it (incomplete character).
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""
        self._num_emitted = 0
        self.stopped_by: str | None = None
        self._flushed = False

    @property
    def text(self) -> str:
        """All text decoded so far (cut at a stop string), including any held-back tail."""
        return self._text

    @property
    def emitted_text(self) -> str:
        """The concatenation of the deltas returned so far."""
        return self._text[: self._num_emitted]

    @property
    def finished(self) -> bool:
        """True once a stop string was hit or ``flush`` was called; later appends are ignored."""
        return self.stopped_by is not None or self._flushed

    def append(self, token_ids: Sequence[int]) -> str:
        """Add newly generated tokens; returns the text that can be shown now (maybe empty)."""
        if self.finished or not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        self._decode_window(final=False)
        return self._take_delta(final=False)

    def flush(self) -> str:
        """Finish the stream: decode any incomplete tail and release held-back text."""
        if self.finished:
            # After a stop string everything before it was already released by append.
            return ""
        self._decode_window(final=True)
        self._flushed = True
        return self._take_delta(final=True)

    # --- internals ----------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_window(self, final: bool) -> None:
        if self._read_offset >= len(self.token_ids):
            return
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        # A trailing replacement char usually means the last token ends mid-character: wait for
        # the rest. At the end of the stream there is no rest, so take it as it is.
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not final):
            return
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        old_len = len(self._text)
        self._text += new_text
        self._check_stop(old_len)

    def _check_stop(self, old_len: int) -> None:
        """Cut the text before the earliest stop string that the new text completes."""
        earliest: tuple[int, str] | None = None
        for s in self.stop:
            # Only occurrences ending in the new text are new; older ones would have stopped us.
            pos = self._text.find(s, max(0, old_len - len(s) + 1))
            if pos != -1 and (earliest is None or pos < earliest[0]):
                earliest = (pos, s)
        if earliest is not None:
            pos, self.stopped_by = earliest
            self._text = self._text[:pos]

    def _take_delta(self, final: bool) -> str:
        # A stopped text is final: nothing after the cut can become a stop string any more.
        if final or self.stopped_by is not None:
            end = len(self._text)
        else:
            end = max(self._num_emitted, len(self._text) - self._holdback)
        delta = self._text[self._num_emitted : end]
        self._num_emitted = end
        return delta
