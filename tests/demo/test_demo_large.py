"""The demo-large variant: 448x448 scenes (256 image tokens, mostly background, print that needs detail), its
training path end to end on CPU, and `--model demo-large` picking its folder (or saying how to train it)."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from flashvlm.demo.scenes import (
    DEMO,
    DEMO_LARGE,
    QUESTION_TYPES,
    WORDS,
    answer_vocabulary,
    make_example,
    make_split,
    render_text,
)
from flashvlm.demo.variants import DEMO_LARGE_VARIANT, VARIANTS

PATCH, MERGE = 14, 2  # the demo configs' vision patch size and spatial merge size
TOKEN = PATCH * MERGE  # one image token covers a 28x28-px square


def _digest(examples) -> str:
    h = hashlib.sha256()
    for ex in examples:
        h.update(np.asarray(ex.image).tobytes())
        h.update(f"{ex.question}|{ex.answer}|{ex.qtype}".encode())
    return h.hexdigest()


def test_the_embedded_models_scenes_and_batches_are_unchanged() -> None:
    """The digests of the DEMO scenes and of a training batch as they were before scene profiles existed: the
    embedded model's recipe must keep seeing the same data (a Pillow upgrade that redraws shapes trips it too)."""
    from flashvlm.demo.train import Batcher, StepBatches, demo_config, demo_tokenizer

    examples = [ex for split in ("train", "validation", "test") for ex in make_split(split, 12, offset=100)]
    assert _digest(examples) == "885c7400c813d334607024901b401b96dba11fcfadfe3fa9b25130d83dd50808"
    assert _digest(examples) == _digest([ex for split in ("train", "validation", "test")
                                         for ex in make_split(split, 12, offset=100, profile=DEMO)])
    tok = demo_tokenizer()
    h = hashlib.sha256()
    for key, value in sorted(StepBatches(Batcher(tok, demo_config(tok).image_token_id), 0, 1, 8)[0].items()):
        h.update(key.encode())
        h.update(value.numpy().tobytes())
    assert h.hexdigest() == "3b8fb0e0dfadb12964ed9d10c1fed6fcb49d27af57e55b5564f51d374b75c420"


def test_large_scenes_are_deterministic_and_seed_sensitive() -> None:
    a, b = make_split("test", 8, profile=DEMO_LARGE), make_split("test", 8, profile=DEMO_LARGE)
    assert _digest(a) == _digest(b)
    assert _digest(a) != _digest(make_split("validation", 8, profile=DEMO_LARGE))
    assert _digest(a) != _digest(make_split("test", 8))  # not the small scenes


def test_every_question_type_balanced_with_known_answers() -> None:
    examples = make_split("train", 200, profile=DEMO_LARGE)
    assert Counter(e.qtype for e in examples) == {t: 50 for t in QUESTION_TYPES}
    assert all(e.answer in set(answer_vocabulary()) for e in examples)
    assert all(e.image.size == (448, 448) and e.image.mode == "RGB" for e in examples)
    assert {e.answer for e in examples if e.qtype == "position"} == {"left", "right", "above", "below"}
    assert {e.answer for e in examples if e.qtype == "count"} >= {"1", "2", "3", "4", "5"}
    assert len({e.answer for e in examples if e.qtype == "text"}) > 25


def test_most_image_tokens_are_plain_background() -> None:
    """Sparse objects: the share of 28x28 token squares holding one colour only (what pruning may drop)."""
    flat = []
    for ex in make_split("validation", 40, profile=DEMO_LARGE):
        px = np.asarray(ex.image).reshape(16, TOKEN, 16, TOKEN, 3).transpose(0, 2, 1, 3, 4).reshape(256, -1, 3)
        flat.append(float((px == px[:, :1]).all(axis=(1, 2)).mean()))
    assert min(flat) >= 0.8 and float(np.mean(flat)) >= 0.9, flat


def _read_text(image: np.ndarray, scale: int) -> list[str]:
    """Every answer whose rendering is exactly the black ink inside the box (the text's own pixels)."""
    black = (image == 0).all(axis=2)
    ys, xs = np.nonzero(black)
    top, left, bottom, right = ys.min(), xs.min(), ys.max(), xs.max()  # the 1-px box outline
    inside = black[top + 1:bottom, left + 1:right]
    matches = []
    for text in [str(i) for i in range(100)] + list(WORDS):
        ink = np.asarray(render_text(text, scale)) > 127
        if (ink.shape[0] + 6, ink.shape[1] + 6) == inside.shape and np.array_equal(inside[3:-3, 3:-3], ink):
            matches.append(text)
    return matches


def test_printed_text_is_legible_and_needs_detail() -> None:
    """The print is exactly recoverable from the pixels (one answer matches), a digit's ink is at least one
    14-px patch tall with 2-px strokes (the size the embedded model reads at 93.6%), and the box covers a few of
    the 256 tokens, so it is detail that coarse pruning loses."""
    texts = [make_example(2_000_003, i, DEMO_LARGE) for i in range(3, 160, 4)]
    assert all(e.qtype == "text" for e in texts)
    for ex in texts:
        assert _read_text(np.asarray(ex.image), DEMO_LARGE.glyph_scale) == [ex.answer]
    digits = np.asarray(render_text("0123456789", DEMO_LARGE.glyph_scale)) > 127
    rows = np.nonzero(digits.any(axis=1))[0]
    assert rows.max() - rows.min() + 1 >= PATCH
    assert DEMO_LARGE.glyph_scale >= 2  # every font pixel a 2x2 block: no 1-px stroke to blur away
    widest = render_text(max(WORDS + ("99",), key=len), DEMO_LARGE.glyph_scale)
    assert (widest.width + 8) * (widest.height + 8) <= 4 * TOKEN * TOKEN


def test_variants_and_model_names_agree() -> None:
    from flashvlm.models.default import DEMO_MODEL_FOLDERS

    assert set(VARIANTS) == set(DEMO_MODEL_FOLDERS)
    assert DEMO_LARGE_VARIANT.pixels == 448 * 448


@pytest.mark.parametrize("variant, expected", [("demo", (3000, 64, 3e-4, None, 0, None)),
                                               ("demo-large", (1600, 256, 3e-4, 289.0, 2, "demo"))])
def test_train_cli_takes_the_variants_recipe_unless_flags_say_otherwise(monkeypatch, tmp_path, variant,
                                                                         expected) -> None:
    from flashvlm.demo import train as train_module
    from flashvlm.models.default import demo_model_dir

    calls = []
    monkeypatch.setattr(train_module, "train", lambda *a, **kw: calls.append((a, kw)))
    argv = ["--out", str(tmp_path), "--device", "cpu"] + ([] if variant == "demo" else ["--variant", variant])
    assert train_module.main(argv) == 0
    args, kw = calls[-1]
    init = None if expected[5] is None else str(demo_model_dir(expected[5]))
    assert (args[1], args[2], args[3], kw["max_seconds"], args[4], kw["init_from"], kw["variant"]) == (
        *expected[:5], init, variant)
    assert train_module.main(argv + ["--steps", "7", "--lr", "1e-4", "--seed", "5", "--init-from", "none"]) == 0
    assert (calls[-1][0][1], calls[-1][0][3], calls[-1][0][2], calls[-1][0][4]) == (7, 1e-4, expected[1], 5)
    assert calls[-1][1]["init_from"] is None
    with pytest.raises(SystemExit):
        train_module.main(["--out", str(tmp_path), "--variant", "huge"])


def test_train_cli_refuses_an_init_from_that_is_no_checkpoint(tmp_path, capsys) -> None:
    from flashvlm.demo import train as train_module

    with pytest.raises(SystemExit):
        train_module.main(["--out", str(tmp_path / "out"), "--init-from", str(tmp_path / "missing"), "--device", "cpu"])
    assert "not a checkpoint folder (no config.json)" in capsys.readouterr().err


def test_a_warm_start_of_another_shape_is_refused(tmp_path) -> None:
    from flashvlm.demo.train import train
    from flashvlm.models.default import demo_model_dir

    with pytest.raises(ValueError, match="has 3 vision and 4 language-model layers"):
        train(str(tmp_path), steps=1, batch_size=1, lr=1e-4, seed=0, device="cpu", validate=False,
              variant="demo-large", init_from=_shallower_copy(demo_model_dir("demo"), tmp_path / "shallow"))


def _shallower_copy(src, dst):
    """The embedded checkpoint's folder with a config that claims 3 vision blocks."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["vision_config"]["depth"] = 3
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.fixture(scope="module")
def large_checkpoint(tmp_path_factory):
    """A few CPU steps of the real demo-large config, saved as its GPU run would be."""
    from flashvlm.demo.train import train

    path = tmp_path_factory.mktemp("large") / "ckpt"
    meta = train(str(path), steps=3, batch_size=2, lr=1e-3, seed=0, device="cpu", log_every=3,
                 variant="demo-large", val_examples=8)
    return path, meta


@pytest.mark.slow
def test_a_tiny_large_training_run_saves_a_loadable_checkpoint(large_checkpoint) -> None:
    from transformers import Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from flashvlm import LLM, SamplingParams

    path, meta = large_checkpoint
    assert meta["variant"] == "demo-large" and meta["scenes"] == "demo-large" and meta["steps"] == 3
    assert len(meta["log"]) == 1 and np.isfinite(meta["log"][0]["loss"])
    assert set(meta["log"][0]["val_by_type"]) == set(QUESTION_TYPES)
    assert (path / "model.safetensors").stat().st_size <= 15 * 10**6  # bf16, as the GPU run saves it
    config = json.loads((path / "config.json").read_text())
    assert config["vision_config"]["patch_size"] == PATCH and config["vision_config"]["spatial_merge_size"] == MERGE
    assert (config["text_config"]["num_hidden_layers"], config["vision_config"]["depth"]) == (
        DEMO_LARGE_VARIANT.text_layers, DEMO_LARGE_VARIANT.vision_depth)

    image = make_example(2_000_003, 2, DEMO_LARGE).image
    grid = Qwen2VLImageProcessorPil.from_pretrained(path)(images=[image], return_tensors="pt")["image_grid_thw"]
    assert grid.tolist() == [[1, 32, 32]] and int(grid.prod()) // MERGE**2 == 256  # transformers' processor

    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=4096)
    ex = make_example(2_000_003, 2, DEMO_LARGE)
    messages = [{"role": "user", "content": [{"type": "image", "image": ex.image},
                                             {"type": "text", "text": ex.question}]}]
    out = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    processed = llm.engine.process_prompt({"prompt_token_ids": out.prompt_token_ids, "images": [ex.image]})
    item = processed.mm_items[0]
    assert item.end - item.offset == 256  # our processor: 256 image tokens a picture
    ids = torch.tensor([processed.prompt_token_ids])
    with torch.inference_mode():
        ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=item.model_pixels(),
                          image_grid_thw=torch.tensor([item.layout]), max_new_tokens=4, min_new_tokens=4,
                          mm_token_type_ids=(ids == llm.engine.model.image_token_id).long(), do_sample=False,
                          eos_token_id=None)
    assert out.token_ids == ref[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_eval_model_demo_large_picks_its_folder_and_its_scenes(large_checkpoint, monkeypatch, tmp_path,
                                                              capsys) -> None:
    from flashvlm.cli import main
    from flashvlm.models import default

    monkeypatch.setattr(default, "_DEMO_DIR", tmp_path)
    shutil.copytree(large_checkpoint[0], tmp_path / "checkpoint-large")
    assert default.resolve_model("demo-large") == str(tmp_path / "checkpoint-large")
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", "demo-large", "--num-examples", "4", "--device", "cpu", "--kv-cache-tokens",
                 "4096", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["scenes"] == "demo-large" and result["num_examples"] == 4
    assert set(result["per_type"]) == set(QUESTION_TYPES)


def test_eval_model_demo_large_before_it_is_trained_says_how(monkeypatch, tmp_path, capsys) -> None:
    from flashvlm.cli import main
    from flashvlm.models import default

    monkeypatch.setattr(default, "_DEMO_DIR", tmp_path)
    assert main(["eval", "--model", "demo-large", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "demo-large demo model is not trained yet" in err and str(tmp_path / "checkpoint-large") in err
    assert "python -m flashvlm.demo.train --variant demo-large --out" in err
    with pytest.raises(FileNotFoundError, match="not trained yet"):
        from flashvlm import LLM

        LLM("demo-large", device="cpu")


def test_model_names_resolve_and_a_users_folder_wins(monkeypatch, tmp_path) -> None:
    from flashvlm.models.default import default_model_path, resolve_model

    assert resolve_model(None) == resolve_model("demo") == str(default_model_path())
    assert resolve_model("/some/ckpt") == "/some/ckpt"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo-large").mkdir()
    assert resolve_model("demo-large") == "demo-large"


def test_eval_scenes_flag_and_the_embedded_models_default(tmp_path) -> None:
    from flashvlm.demo.evaluate import trained_scenes
    from flashvlm.models.default import default_model_path

    assert trained_scenes(default_model_path()) is DEMO  # trained before training.json named its scenes
    assert trained_scenes(tmp_path) is DEMO
    (tmp_path / "training.json").write_text(json.dumps({"scenes": "demo-large"}))
    assert trained_scenes(tmp_path) is DEMO_LARGE
    (tmp_path / "training.json").write_text(json.dumps({"scenes": "nope"}))
    with pytest.raises(ValueError, match="unknown scene profile"):
        trained_scenes(tmp_path)
