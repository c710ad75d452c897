"""The synthetic VQA generator: deterministic per seed, balanced over question types, answers well formed."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from flashvlm.demo.scenes import IMAGE_SIZE, QUESTION_TYPES, answer_vocabulary, make_example, make_split


def test_deterministic_and_seed_sensitive() -> None:
    a, b = make_split("test", 8), make_split("test", 8)
    assert [(e.question, e.answer) for e in a] == [(e.question, e.answer) for e in b]
    assert all(np.array_equal(np.asarray(x.image), np.asarray(y.image)) for x, y in zip(a, b))
    other = make_split("validation", 8)
    assert [np.asarray(e.image).tobytes() for e in a] != [np.asarray(e.image).tobytes() for e in other]


def test_types_balanced_and_answers_known() -> None:
    examples = make_split("train", 400)
    assert Counter(e.qtype for e in examples) == {t: 100 for t in QUESTION_TYPES}
    vocab = set(answer_vocabulary())
    assert all(e.answer in vocab for e in examples)
    assert all(e.image.size == (IMAGE_SIZE, IMAGE_SIZE) and e.image.mode == "RGB" for e in examples)
    positions = Counter(e.answer for e in examples if e.qtype == "position")
    assert set(positions) == {"left", "right", "above", "below"}


def test_unknown_split() -> None:
    with pytest.raises(ValueError, match="unknown split"):
        make_split("dev", 1)


def test_text_questions_need_the_pixels() -> None:
    """The printed text differs between examples, so a model cannot answer from the question alone."""
    texts = [make_example(5, i) for i in range(3, 400, 4)]
    assert all(e.qtype == "text" for e in texts)
    assert len({e.answer for e in texts}) > 30
