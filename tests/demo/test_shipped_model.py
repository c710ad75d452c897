"""The shipped demo checkpoint: a real model answering, through our engine and through transformers alike."""

from __future__ import annotations

import json

import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.cli import main
from flashvlm.demo.scenes import QUESTION_TYPES, SPLIT_SEEDS, make_example
from flashvlm.models.default import default_model_path


def test_checkpoint_is_small_and_records_its_recipe() -> None:
    path = default_model_path()
    assert sum(f.stat().st_size for f in path.iterdir()) <= 20 * 2**20
    meta = json.loads((path / "training.json").read_text())
    assert meta["device"] == "cuda" and meta["init_from"]["seed"] == 0  # the two-stage recipe of docs/demo.md
    assert meta["log"][-1]["val_exact"] >= 0.9


@pytest.mark.slow
def test_eval_cli_accuracy_on_a_test_split(tmp_path, capsys) -> None:
    """`flashvlm eval` on the default model: a real model answering, every question type among the scores."""
    out = tmp_path / "eval.json"
    assert main(["eval", "--num-examples", "200", "--batch-size", "100", "--device", "cpu",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["per_type"]) == set(QUESTION_TYPES)
    assert result["accuracy"] >= 0.85, capsys.readouterr().out
    assert result["per_type"]["text"]["accuracy"] >= 0.7  # the fine-detail type reads printed text


def test_greedy_answers_equal_transformers_on_scenes() -> None:
    from transformers import Qwen2VLForConditionalGeneration

    path = str(default_model_path())
    llm = LLM(path, device="cpu", dtype="float32", kv_cache_tokens=4096)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    examples = [make_example(SPLIT_SEEDS["test"], 7000 + i) for i in range(8)]
    messages = [[{"role": "user", "content": [{"type": "image", "image": ex.image},
                                               {"type": "text", "text": ex.question}]}] for ex in examples]
    outs = llm.chat(messages, params)
    right = 0
    for ex, out in zip(examples, outs):
        processed = llm.engine.process_prompt({"prompt_token_ids": out.prompt_token_ids, "images": [ex.image]})
        ids = torch.tensor([processed.prompt_token_ids])
        item = processed.mm_items[0]
        with torch.inference_mode():
            ref = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=item.model_pixels(),
                              image_grid_thw=torch.tensor([item.layout]),
                              mm_token_type_ids=(ids == llm.engine.model.image_token_id).long(),
                              max_new_tokens=4, do_sample=False)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist()[: len(out.token_ids)]
        right += out.text.strip() == ex.answer
    assert right >= 6


def test_large_checkpoint_is_small_and_records_its_recipe() -> None:
    from flashvlm.demo.variants import DEMO_LARGE_VARIANT
    from flashvlm.models.default import demo_model_dir

    path = demo_model_dir("demo-large")
    assert sum(f.stat().st_size for f in path.iterdir()) <= 15 * 2**20
    meta = json.loads((path / "training.json").read_text())
    recipe = DEMO_LARGE_VARIANT.recipe
    assert (meta["variant"], meta["scenes"]) == ("demo-large", "demo-large")
    assert (meta["steps"], meta["batch_size"], meta["lr"], meta["seed"]) == (recipe.steps, recipe.batch_size,
                                                                            recipe.lr, recipe.seed)
    assert meta["stopped_early_at_step"] is None and meta["train_seconds"] <= recipe.max_seconds
    assert meta["init_from"]["seed"] == 1  # warm-started from the embedded model (its second stage)
    assert meta["log"][-1]["val_exact"] >= 0.9


@pytest.mark.slow
def test_eval_demo_large_unpruned_and_pruned(tmp_path) -> None:
    """`flashvlm eval --model demo-large`: 256 image tokens a picture, accurate unpruned; divprune at 0.25 hands
    the language model a quarter of them and the report counts them."""
    accuracy = {}
    for name, flags in (("none", []), ("divprune", ["--mm-token-pruning", "divprune", "--mm-token-keep-ratio",
                                                    "0.25"])):
        out = tmp_path / f"{name}.json"
        assert main(["eval", "--model", "demo-large", "--num-examples", "200", "--batch-size", "100", "--device",
                     "cpu", "--json", str(out), *flags]) == 0
        result = json.loads(out.read_text())
        assert result["scenes"] == "demo-large" and result["image_tokens"] == 200 * 256
        accuracy[name] = result["accuracy"]
        kept = 200 * 256 if name == "none" else 200 * 64
        assert result["image_tokens_kept"] == kept
    assert accuracy["none"] >= 0.88
    assert accuracy["divprune"] < accuracy["none"]  # pruning costs something on this model, and is measured
