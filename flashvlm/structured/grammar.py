"""The grammar engine behind structured outputs: xgrammar (chosen by measurement, docs/structured_outputs.md).

`GrammarEngine` compiles a request's StructuredOutputsParams against the tokenizer's vocabulary (cached by the
constraint, so the server's grammar thread compiles it once and the engine thread finds it) and makes one
`Matcher` per request: it fills the request's row of the step's token bitmask (bit t of row r: token t allowed)
and accepts each sampled token. xgrammar is an optional dependency (`pip install flashvlm[structured]`); without
it a constrained request is refused with an InvalidRequestError (a 400) naming the package.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from flashvlm.request import InvalidRequestError
from flashvlm.runner.token_mask import words_per_row
from flashvlm.structured.params import StructuredOutputsParams

COMPILE_CACHE_BYTES = 256 << 20
"""xgrammar's cache of compiled grammars (a schema's grammar on a 150k vocabulary is a few MB)."""
COMPILED_CACHE_ENTRIES = 64
"""Compiled grammars kept by constraint text: a repeated schema (every ticket of a form) skips its compile."""
COMPILE_THREADS = 2
"""Threads one compile may use; the server compiles on a thread of its own, never on the engine's."""
FILL_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads that fill one step's bitmask rows (xgrammar's batch matcher), on the engine thread's behalf."""
MISSING = "structured outputs need the xgrammar package, which is not installed: pip install 'flashvlm[structured]'"

ANY_OBJECT = '{"type": "object"}'
"""json_object's schema. JSON outputs take no free whitespace (xgrammar's any_whitespace off, separators ", " and
": "): otherwise a weak model can pad with spaces until max_tokens."""

COUNTED_CHAR = r'[^\"\\\r\n]'
"""How xgrammar 0.2.9 writes one character of a string with minLength / maxLength in its EBNF: anything but quote,
backslash and line breaks, raw control characters included, which is not JSON. The engine compiles such a
schema's grammar text with JSON_STRING_CHAR in its place (same compile time; a pattern of as many characters
instead compiled up to 400 times slower). Should a later xgrammar write it otherwise, the text no longer
holds it and the schema compiles as it is (tests/unit/test_structured_engine.py then fails)."""
JSON_STRING_CHAR = r'[^\"\\\0-\x1f]'
"""One unescaped character of a JSON string (counted strings hold no escapes, as in xgrammar's own)."""

_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON grammar"}
"""How messages name a constraint kind (the others by their field name)."""

# xgrammar's messages start with "[time] /path/file.cc:line: "; the rest names the problem.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class Matcher:
    """One request's grammar state: the tokens accepted so far and the set allowed next."""

    def __init__(self, matcher: Any, stop_token_ids: tuple[int, ...]) -> None:
        self._m = matcher
        """xgrammar's GrammarMatcher (the batch calls of GrammarEngine take it)."""
        self.stop_token_ids = stop_token_ids
        self.num_accepted = 0
        """Tokens accepted since the last reset (the stop token included)."""

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it. Once the grammar has
        ended (is_terminated), every further token is taken as padding: only stop tokens are allowed then."""
        if self._m.is_terminated():
            ok = token_id in self.stop_token_ids
        else:
            ok = self._m.accept_token(token_id)
        self.num_accepted += ok
        return ok

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, host memory)."""
        if self._m.is_terminated():
            bitmask[row].zero_()
            for t in self.stop_token_ids:
                if t // 32 < bitmask.shape[1]:
                    bitmask[row, t // 32] |= _bit(t % 32)
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """The grammar has ended and a stop token was accepted."""
        return self._m.is_terminated()

    def reset(self) -> None:
        self._m.reset()
        self.num_accepted = 0


def _bit(i: int) -> int:
    """Bit i of an int32 word as a Python int that fits int32 (bit 31 is the sign bit)."""
    return -(1 << 31) if i == 31 else 1 << i


class GrammarEngine:
    """Compiles constraints for one tokenizer and vocabulary; thread-safe (compiles run in several threads)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler: Any = None
        self._batch: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        """Compiled grammars by StructuredOutputsParams.cache_key, least recently used first."""

    @staticmethod
    def available() -> bool:
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            return False
        return True

    def _get_compiler(self) -> Any:
        with self._lock:  # the vocabulary index takes ~0.6 s on a 150k vocabulary: built once, on first use
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise InvalidRequestError(MISSING) from None
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.stop_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS,
                                                     cache_limit_bytes=COMPILE_CACHE_BYTES)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar of `spec`; an invalid schema, regex or grammar raises InvalidRequestError naming it.
        Cached here by the constraint's text, so the grammar thread's compile serves the engine thread's matchers
        (one per sample): xgrammar caches only its last step, not the schema-to-grammar conversion before it."""
        key = spec.cache_key()
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiled = self._compile(spec)
        self._refuse_without_a_first_token(spec, compiled)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > COMPILED_CACHE_ENTRIES:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        compiler = self._get_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                return self._compile_schema(compiler, spec.schema_text())
            if kind == "json_object":
                return compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses with its parser's message
            message = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            name = _KIND_NAMES.get(kind, kind)
            raise InvalidRequestError(f"invalid structured_outputs {name}: {message}") from None

    def _refuse_without_a_first_token(self, spec: StructuredOutputsParams, compiled: Any) -> None:
        """A constraint no token of this vocabulary can begin (a letters-only regex on a tokenizer whose words
        all hold digits, say) would give every row an all-masked step: refuse it here, with the request's 400."""
        import xgrammar as xgr

        bitmask = torch.zeros((1, words_per_row(self.vocab_size)), dtype=torch.int32)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise InvalidRequestError(f"structured_outputs {_KIND_NAMES.get(spec.kind, spec.kind)}: no token of this "
                                      "model's vocabulary can begin its output")

    @staticmethod
    def _compile_schema(compiler: Any, schema: str) -> Any:
        """xgrammar's grammar of `schema`, with its counted strings' characters fixed (COUNTED_CHAR)."""
        import xgrammar as xgr

        text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
        if COUNTED_CHAR in text:
            return compiler.compile_grammar(text.replace(COUNTED_CHAR, JSON_STRING_CHAR))
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        import xgrammar as xgr

        return Matcher(xgr.GrammarMatcher(self.compile(spec)), self.stop_token_ids)

    # One C++ call per step for every row, not one Python call per row: at batch 32 the per-row calls cost more
    # than the grammar work itself.
    def accept_batch(self, matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]:
        """Matcher.accept of one token each, for matchers that have not terminated."""
        import xgrammar as xgr

        accepted = xgr.BatchGrammarMatcher.batch_accept_token([m._m for m in matchers], list(tokens))
        for m, ok in zip(matchers, accepted):
            m.num_accepted += bool(ok)
        return [bool(ok) for ok in accepted]

    def fill_batch(self, matchers: Sequence[Matcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Matcher.fill of bitmask[rows[k]] for each matchers[k] (none terminated)."""
        with self._lock:
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
        self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, list(rows))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)
