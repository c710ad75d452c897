"""Image placeholders in a prompt: one token per image is expanded wherever it sits, back to back included (as
HF's processors do); a prompt already expanded is taken as it is; wrong counts get an error that says why."""

from __future__ import annotations

import numpy as np
import pytest

from flashvlm.config import ModelConfig
from flashvlm.models.loader import read_checkpoint
from flashvlm.processing.input_processor import InputProcessor
from flashvlm.request import InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_llava, build_qwen2_vl

PLACEHOLDER = {"llava": "<image>", "qwen2_vl": "<|image_pad|>"}


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def family(request, tmp_path_factory) -> tuple[InputProcessor, str]:
    build = build_llava if request.param == "llava" else build_qwen2_vl
    checkpoint = read_checkpoint(ModelConfig(model=str(build(tmp_path_factory.mktemp(request.param)))))
    placeholder = PLACEHOLDER[request.param]
    return InputProcessor(checkpoint, 512, checkpoint.tokenizer.convert_tokens_to_ids(placeholder)), placeholder


def _images(*sizes: tuple[int, int]) -> list[np.ndarray]:
    rng = np.random.default_rng(len(sizes))
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in sizes]


def _image_spans(ip: InputProcessor, ids: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, t in enumerate([*ids, -1]):
        if t == ip.image_token_id and start is None:
            start = i
        elif t != ip.image_token_id and start is not None:
            spans.append((start, i - start))
            start = None
    return spans


@pytest.mark.parametrize("joiner", ["", "\n"])
def test_each_placeholder_expands_on_its_own(family, joiner) -> None:
    ip, ph = family
    images = _images((80, 60), (56, 112), (84, 56))
    processed = ip.process({"prompt": joiner.join([ph] * 3) + " compare", "images": images})
    items = processed.mm_items
    assert items[0].offset == 0  # these tokenizers add no BOS
    ids = processed.prompt_token_ids
    assert ids.count(ip.image_token_id) == sum(it.num_tokens for it in items)
    for a, b in zip(items, items[1:]):
        assert b.offset == a.offset + a.num_tokens + len(ip.tokenizer.encode(joiner, add_special_tokens=False))
    if joiner:
        assert _image_spans(ip, ids) == [(it.offset, it.num_tokens) for it in items]
    else:
        assert _image_spans(ip, ids) == [(0, sum(it.num_tokens for it in items))]


@pytest.mark.parametrize("joiner", ["", "\n"])
def test_expanded_prompt_is_taken_as_is(family, joiner) -> None:
    # Back to back, two expansions are one run: it is split at the first image's token count.
    ip, ph = family
    images = _images((80, 60), (56, 112), (84, 56))
    once = ip.process({"prompt": joiner.join([ph] * 3) + " compare", "images": images})
    again = ip.process({"prompt_token_ids": once.prompt_token_ids, "images": images})
    assert again.prompt_token_ids == once.prompt_token_ids
    assert [it.offset for it in again.mm_items] == [it.offset for it in once.mm_items]


def test_expanded_runs_of_the_wrong_length_are_named(family) -> None:
    ip, ph = family
    images = _images((80, 60), (80, 60))
    n = ip.process({"prompt": ph, "images": images[:1]}).mm_items[0].num_tokens
    ids = ip.tokenizer.encode(" x".join([ph * n, ph * (n + 1)]), add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match=rf"runs of \[{n}, {n + 1}\].*\[{n}, {n}\] tokens"):
        ip.process({"prompt_token_ids": ids, "images": images})


@pytest.mark.parametrize("placeholders, n_images", [(3, 2), (1, 2), (0, 1), (2, 0)])
def test_wrong_placeholder_counts_are_refused(family, placeholders, n_images) -> None:
    ip, ph = family
    with pytest.raises(InvalidRequestError, match=f"{placeholders} image placeholder.*but {n_images} image"):
        ip.process({"prompt": ph * placeholders + " hi", "images": _images(*[(56, 56)] * n_images)})
