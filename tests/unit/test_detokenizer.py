"""Incremental detokenizer against full decodes, with tokenizers built in code (no downloads)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flashvlm.engine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you doing today?",
    "Vision-language models read images and answer questions about them.",
    "你好，世界！今天天气很好。",
    "日本語のテキストも少しあります。",
    "Emoji time: 😀 🎉 🚀 👍🏽 and café naïve résumé.",
    "def foo(x):\n    return x * 2\n",
]
ASCII_CORPUS = [line for line in CORPUS if line.isascii()]
BYTE_PIECES = [f"<0x{b:02X}>" for b in range(256)]
SP_SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """Qwen-like: byte-level BPE, so CJK and emoji split into byte tokens with a small vocab."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 3, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)


def wrap_sentencepiece(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


def llama_bpe() -> PreTrainedTokenizerFast:
    """Llama-2-like: sentencepiece BPE with byte fallback and a Strip decoder for the leading '▁'."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    # Capped piece length: with no pre-tokenizer, BPE would otherwise learn whole sentences.
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SP_SPECIALS, max_token_length=6,
                                  show_progress=False)
    tok.train_from_iterator(ASCII_CORPUS * 3, trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = dict(trained["vocab"])
    for piece in BYTE_PIECES:
        vocab[piece] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    full = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    full.normalizer = normalizer
    full.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    full.add_special_tokens(SP_SPECIALS)
    return wrap_sentencepiece(full)


def unigram_metaspace() -> PreTrainedTokenizerFast:
    """Sentencepiece-unigram-like: Metaspace pre-tokenizer and decoder, byte fallback."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(ASCII_CORPUS * 3, trainers.UnigramTrainer(
        vocab_size=150, special_tokens=SP_SPECIALS, unk_token="<unk>", show_progress=False))
    vocab = [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]
    full = Tokenizer(models.Unigram(vocab + [(p, -100.0) for p in BYTE_PIECES], unk_id=0, byte_fallback=True))
    full.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    full.decoder = decoders.Sequence([decoders.ByteFallback(),
                                      decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    full.add_special_tokens(SP_SPECIALS)
    return wrap_sentencepiece(full)


BUILDERS: dict[str, Callable[[], PreTrainedTokenizerFast]] = {
    "byte_level": byte_level_bpe, "llama": llama_bpe, "metaspace": unigram_metaspace,
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return BUILDERS[request.param]()


PIECES = ["hello", " world", "the", " ", "  ", "\n", ".", "!", "你好", "世界", "天气", "😀", "🎉", "👍🏽",
          "café", "é", "naïve", "fox", " 日本語", "x", "Ω", "🚀🚀", "ß"]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 25)))


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> tuple[str, list[str]]:
    """Feed ids in random chunks of 1-3 tokens; returns all text shown and the deltas."""
    deltas = []
    pos = 0
    while pos < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.append(ids[pos : pos + n]))
        pos += n
    deltas.append(detok.flush())
    return "".join(deltas), deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_concatenate_to_full_decode(tokenizer: Any, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    for _ in range(60):
        # Specials go only between whole characters: mid-character they make invalid UTF-8,
        # whose replacement chars byte-fallback decoders place differently in every window.
        ids: list[int] = []
        for _ in range(rng.randint(1, 3)):
            ids += tokenizer.encode(random_text(rng), add_special_tokens=False)
            if rng.random() < 0.5:
                ids.append(rng.choice(specials))
        detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=skip_special_tokens, stop=[])
        shown, deltas = stream(detok, ids, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert shown == expected
        assert detok.text == expected
        if "\ufffd" not in expected:  # a special token dropped mid-character does make one
            assert all("\ufffd" not in d for d in deltas)


def test_random_byte_level_ids_match_full_decode() -> None:
    # Byte-level decoding is lossless per byte, so even arbitrary (invalid UTF-8) streams must match.
    tok = byte_level_bpe()
    rng = random.Random(1)
    for _ in range(100):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=[])
        assert stream(detok, ids, rng)[0] == tok.decode(ids, skip_special_tokens=True)


def test_emoji_split_across_tokens_waits_for_completion() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("a👍🏽", add_special_tokens=False)
    assert len(ids) > 3  # the emoji is several byte tokens in this small vocab
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=[])
    deltas = [detok.append([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == "a👍🏽"


class CountingTokenizer:
    """Records how many ids each decode call gets, to prove decoding stays windowed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_decode_window_stays_small(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello world 你好 😀 " * 40, add_special_tokens=False)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [], skip_special_tokens=True, stop=[])
    text = "".join(detok.append([i]) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(ids) > 100 and max(counting.lengths) <= 8


def run_with_stop(
    tok: Any, text: str, stop: list[str], chunk: int = 1,
) -> tuple[IncrementalDetokenizer, list[str]]:
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True, stop=stop)
    deltas = []
    for pos in range(0, len(ids), chunk):
        deltas.append(detok.append(ids[pos : pos + chunk]))
        # Nothing shown may ever reach past where the final text will be cut.
        assert "".join(deltas) == detok.emitted_text
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_string_truncates(tokenizer: Any, chunk: int) -> None:
    detok, deltas = run_with_stop(tokenizer, "Hello world! How are you doing today?", ["How"], chunk)
    assert detok.stopped_by == "How"
    assert detok.text == "Hello world! "
    assert "".join(deltas) == "Hello world! "
    assert detok.append(tokenizer.encode(" more", add_special_tokens=False)) == ""
    assert detok.text == "Hello world! "


def test_stop_string_spanning_two_tokens(tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Find a token boundary inside the text and build a stop string straddling it.
    ends = [len(tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    boundary = next(e for e in ends if 6 <= e < len(text) - 3 and text.index(text[e - 2 : e + 2]) == e - 2)
    stop = text[boundary - 2 : boundary + 2]
    detok, deltas = run_with_stop(tokenizer, text, [stop])
    cut = text.index(stop)
    assert detok.stopped_by == stop
    assert "".join(deltas) == detok.text == text[:cut]


def test_stop_string_with_multibyte_chars(tokenizer: Any) -> None:
    detok, deltas = run_with_stop(tokenizer, "ok 😀 你好世界 done", ["好世"])
    assert detok.stopped_by == "好世"
    assert "".join(deltas) == "ok 😀 你"


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    text = "the lazy dog and the quick fox"
    detok, deltas = run_with_stop(tokenizer, text, ["quick", "dog", "zzz-long"], chunk=50)
    assert detok.stopped_by == "dog"
    assert "".join(deltas) == "the lazy "


def test_holdback_released_on_flush(tokenizer: Any) -> None:
    text = "hello world hello"
    detok, deltas = run_with_stop(tokenizer, text, ["xyz!"])
    assert detok.stopped_by is None
    shown_before_flush = "".join(deltas[:-1])
    assert len(text) - len(shown_before_flush) <= 3  # at most len("xyz!") - 1 held back
    assert shown_before_flush + deltas[-1] == text
    assert detok.flush() == ""


def test_skip_special_tokens() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("hi there", add_special_tokens=False) + [tok.eos_token_id]
    for skip, expected in [(True, "hi there"), (False, "hi there<|endoftext|>")]:
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip, stop=[])
        assert "".join(detok.append([i]) for i in ids) + detok.flush() == expected


def test_sentencepiece_first_token_has_no_leading_space() -> None:
    # Output text is decoded on its own (like tokenizer.decode(output_ids)), not after the prompt.
    tok = llama_bpe()
    prompt = tok.encode("Hello", add_special_tokens=False)
    out = tok.encode("world hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True, stop=[])
    shown = "".join(detok.append([i]) for i in out) + detok.flush()
    assert shown == "world hello"


def test_fast_backend_decode_only_where_it_equals_transformers(tokenizer: Any) -> None:
    """The Rust decode stands in for transformers' only without the clean-up of tokenization spaces (which the
    wrapper applies after decoding); there it gives the same text."""
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok._fast_decode is not None
    rng = random.Random(5)
    for _ in range(20):
        ids = tokenizer.encode(random_text(rng), add_special_tokens=False)
        for skip in (True, False):
            assert detok._fast_decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert IncrementalDetokenizer(tokenizer, [])._fast_decode is None
    finally:
        tokenizer.clean_up_tokenization_spaces = False
