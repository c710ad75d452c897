"""Two training steps on CPU give a checkpoint that transformers and flashvlm load and agree on."""

from __future__ import annotations

import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.demo.evaluate import evaluate, format_report
from flashvlm.demo.scenes import make_split
from flashvlm.demo.train import Batcher, train


@pytest.mark.slow
def test_train_two_steps_then_load_and_eval(tmp_path) -> None:
    meta = train(str(tmp_path / "ckpt"), steps=2, batch_size=4, lr=1e-3, seed=0, device="cpu", log_every=1)
    assert len(meta["log"]) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in meta["log"])
    path = str(tmp_path / "ckpt")
    llm = LLM(path, device="cpu", kv_cache_tokens=4096)
    result = evaluate(llm, num_examples=8, batch_size=8)
    assert result["num_examples"] == 8 and set(result["per_type"]) == {"colour", "count", "position", "text"}
    assert "overall" in format_report(result)

    from transformers import Qwen2VLForConditionalGeneration

    hf = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ex = make_split("test", 1)[0]
    batcher = Batcher(llm.get_tokenizer(), llm.engine.model.image_token_id)
    ids = batcher.prompt_ids(ex.question)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ours = llm.generate({"prompt_token_ids": ids, "images": [ex.image]}, params)[0].token_ids
    item = llm.engine.process_prompt({"prompt_token_ids": ids, "images": [ex.image]}).mm_items[0]
    t = torch.tensor([ids])
    with torch.inference_mode():
        ref = hf.generate(input_ids=t, attention_mask=torch.ones_like(t), pixel_values=item.model_pixels(),
                          image_grid_thw=torch.tensor([item.layout]), mm_token_type_ids=(t == batcher.image_token_id)
                          .long(), max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=None)
    assert ours == ref[0, len(ids):].tolist()


def test_eval_cli(tmp_path, capsys) -> None:
    import json

    from flashvlm.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", "--num-examples", "4", "--device", "cpu", "--json", str(out)]) == 0
    assert "overall" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["num_examples"] == 4 and len(result["per_type"]) == 4
    assert main(["eval", "--num-examples", "0", "--device", "cpu"]) == 1


def test_batcher_positions_equal_transformers_rope_index() -> None:
    """The trainer hands transformers precomputed M-RoPE positions; they must be the ones it would compute."""
    from transformers import Qwen2VLForConditionalGeneration

    from flashvlm.demo.scenes import make_example
    from flashvlm.demo.train import demo_config, demo_tokenizer

    tok = demo_tokenizer()
    cfg = demo_config(tok)
    batch = Batcher(tok, cfg.image_token_id)([make_example(3, i) for i in range(6)], "cpu")
    model = Qwen2VLForConditionalGeneration(cfg)
    ref, _ = model.model.get_rope_index(batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                                        attention_mask=batch["attention_mask"],
                                        mm_token_type_ids=batch["mm_token_type_ids"])
    real = batch["attention_mask"].bool()
    assert torch.equal(batch["position_ids"][:, real], ref[:, real])
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1  # rows of different lengths: padding covered


def test_batched_vision_attention_equals_transformers_per_image_loop() -> None:
    from transformers import Qwen2VLForConditionalGeneration

    from flashvlm.demo.scenes import make_example
    from flashvlm.demo.train import batch_vision_attention, demo_config, demo_tokenizer

    tok = demo_tokenizer()
    cfg = demo_config(tok)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    batcher = Batcher(tok, cfg.image_token_id)
    batch = batcher([make_example(1, i) for i in range(4)], "cpu")
    with torch.no_grad():
        ref = model(**batch).logits
        batch_vision_attention(model, batcher.patches_per_image)
        out = model(**batch).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    calls = [m.batched_attention_calls for m in model.modules() if hasattr(m, "batched_attention_calls")]
    assert len(calls) == cfg.vision_config.depth and all(c == 1 for c in calls)


@pytest.mark.slow
def test_continue_training_from_a_checkpoint(tmp_path) -> None:
    import json

    first = tmp_path / "a"
    train(str(first), steps=2, batch_size=4, lr=3e-4, seed=0, device="cpu", log_every=2)
    # lr 0: the second run must hand back exactly the weights it started from
    meta = train(str(tmp_path / "b"), steps=2, batch_size=4, lr=0.0, seed=1, device="cpu", log_every=2,
                 init_from=str(first))
    assert meta["init_from"]["seed"] == 0 and meta["init_from"]["steps"] == 2
    saved = json.loads((tmp_path / "b" / "training.json").read_text())
    assert saved["init_from"]["lr"] == 3e-4 and saved["seed"] == 1
    from safetensors.torch import load_file

    a, b = load_file(first / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_budget_probe_and_a_cut_schedule(tmp_path) -> None:
    from flashvlm.demo.train import steps_for_budget

    assert steps_for_budget(1000.0, batch_size=2, lr=3e-4, seed=0, device="cpu", workers=0, timed_steps=2) >= 1
    meta = train(str(tmp_path / "c"), steps=2, batch_size=2, lr=3e-4, seed=0, device="cpu", validate=False,
                 schedule_steps=10)
    assert (meta["steps"], meta["schedule_steps"]) == (2, 10)


def test_pixel_values_from_raw_scenes_equal_the_processor() -> None:
    """The trainer's batched uint8 -> pixel_values path (run on the GPU there) is the processor's, bit for bit."""
    from flashvlm.demo.scenes import make_example
    from flashvlm.demo.train import demo_config, demo_tokenizer

    tok = demo_tokenizer()
    batcher = Batcher(tok, demo_config(tok).image_token_id)
    examples = [make_example(4, i) for i in range(5)]
    reference = batcher(examples, "cpu")
    raw = batcher(examples, "cpu", raw_pixels=True)
    assert raw["images_u8"].dtype == torch.uint8 and "pixel_values" not in raw
    assert torch.equal(batcher.pixel_values(raw["images_u8"]), reference["pixel_values"])
    assert torch.equal(raw["image_grid_thw"], reference["image_grid_thw"])


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--steps", "10", "--schedule-steps", "5"],
                                  ["--time-budget-s", "-1"]])
def test_bad_training_arguments_are_refused(tmp_path, argv, capsys) -> None:
    from flashvlm.demo.train import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "x"), "--device", "cpu", *argv])
    assert e.value.code == 2 and "error" in capsys.readouterr().err
