"""CPU comparison of the grammar engines behind structured outputs: xgrammar and llguidance.

For one tokenizer (a tokenizer directory; the tiny checkpoints' or a Qwen2-sized byte-level BPE trained offline),
times: building the engine's vocabulary index, compiling each constraint (cold: a fresh compiler, no cache), and
the per-token mask (filling the next-token bitmask, then accepting the token) while walking a valid output token
by token. Prints one line per engine and constraint. Used for the numbers in docs/structured_outputs.md:
  python scripts/bench_grammar.py flashvlm/demo/checkpoint [more tokenizer dirs]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "priority": {"enum": ["low", "medium", "high"]},
    "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "urgent": {"type": "boolean"}},
    "required": ["title", "priority", "count", "tags", "urgent"], "additionalProperties": False}
INSTANCE = json.dumps({"title": "Login page shows a blank screen", "priority": "high", "count": 3,
                       "tags": ["ui", "login"], "urgent": True}, separators=(",", ":"))
REGEX = r"[A-Z]{3}-[0-9]{4}( \(urgent\))?"
REGEX_TEXT = "ABC-1234 (urgent)"
CHOICES = ["positive", "negative", "neutral"]

CASES = {  # name -> (xgrammar compile, llguidance grammar, a valid output)
    "json_schema": (lambda c: c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                          separators=(",", ":")),
                    lambda m: m.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False}), INSTANCE),
    "json_object": (lambda c: c.compile_builtin_json_grammar(),
                    lambda m: m.grammar_from_json_schema({"type": "object"}), INSTANCE),
    "regex": (lambda c: c.compile_regex(REGEX), lambda m: m.grammar_from_regex(REGEX), REGEX_TEXT),
    "choice": (lambda c: c.compile_regex("(positive|negative|neutral)"),
               lambda m: m.grammar_from_regex("(positive|negative|neutral)"), "neutral"),
}


def _ms(seconds: list[float]) -> str:
    return f"median {statistics.median(seconds) * 1e3:.3f} ms, max {max(seconds) * 1e3:.3f} ms"


def bench_xgrammar(tok, vocab: int, eos: int) -> None:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=[eos])
    print(f"xgrammar   tokenizer info {1e3 * (time.perf_counter() - t0):.1f} ms")
    for name, (compile_fn, _, text) in CASES.items():
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compile_fn(compiler)
        compile_s = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        steps = []
        for t in tok.encode(text, add_special_tokens=False) + [eos]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            ok = matcher.accept_token(t)
            steps.append(time.perf_counter() - t0)
            assert ok, (name, t)
        print(f"xgrammar   {name:12s} compile {compile_s * 1e3:8.1f} ms; per token ({len(steps)}) {_ms(steps)}")


def bench_llguidance(tok, vocab: int, eos: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    print(f"llguidance tokenizer info {1e3 * (time.perf_counter() - t0):.1f} ms")
    for name, (_, grammar_fn, text) in CASES.items():
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grammar_fn(llguidance.LLMatcher))
        assert not matcher.is_error(), matcher.get_error()
        compile_s = time.perf_counter() - t0
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
        steps = []
        for t in tok.encode(text, add_special_tokens=False) + [eos]:
            t0 = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            ok = matcher.consume_token(t)
            steps.append(time.perf_counter() - t0)
            assert ok, (name, t, matcher.get_error())
        print(f"llguidance {name:12s} compile {compile_s * 1e3:8.1f} ms; per token ({len(steps)}) {_ms(steps)}")


def main(paths: list[str]) -> None:
    torch.set_num_threads(1)
    for path in paths:
        tok = AutoTokenizer.from_pretrained(path)
        vocab = len(tok)
        print(f"== {path}: vocabulary {vocab}")
        bench_xgrammar(tok, vocab, tok.eos_token_id)
        bench_llguidance(tok, vocab, tok.eos_token_id)


if __name__ == "__main__":
    main(sys.argv[1:])
