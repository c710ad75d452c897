"""Train the embedded demo model: a tiny Qwen2-VL-architecture VLM on the synthetic scenes of `scenes.py`.

    python -m flashvlm.demo.train --out DIR --steps N --batch-size 128 --device cuda
    python -m flashvlm.demo.train --out DIR --time-budget-s 450 --batch-size 128   # N from a timed probe
    python -m flashvlm.demo.train --variant demo-large --out flashvlm/demo/checkpoint-large   # its own recipe

Seeded end to end (tokenizer, initial weights, data order), so the same command (with the step count a budgeted
run recorded in training.json) gives the same checkpoint on the same hardware. The result is a normal Hugging
Face folder that transformers and flashvlm both load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from flashvlm.demo.scenes import DEMO, QUESTION_TYPES, SceneProfile, answer_vocabulary, make_example, make_split
from flashvlm.demo.variants import DEMO_VARIANT, VARIANTS, DemoVariant, demo_variant
from flashvlm.models.default import resolve_model
from flashvlm.models.qwen2_vl import mrope_positions
from flashvlm.processing.qwen_image import QwenImageProcessor
from flashvlm.testing.tiny_checkpoints import (
    QWEN_CHAT_TEMPLATE,
    QWEN_SPECIAL_TOKENS,
    build_tokenizer,
    qwen_preprocessor_config,
)

PREFETCH = 2  # batches each loader worker keeps ready


def demo_tokenizer():
    # Every profile asks the same questions with the same answers: one tokenizer serves every variant.
    questions = [make_example(0, i).question for i in range(400)]
    corpus = questions + answer_vocabulary() + ["system", "user", "assistant", "You are a helpful assistant."]
    return build_tokenizer(QWEN_SPECIAL_TOKENS, 600, QWEN_CHAT_TEMPLATE, eos="<|im_end|>", bos=None,
                           pad="<|endoftext|>", corpus=corpus)


def demo_config(tokenizer, variant: DemoVariant = DEMO_VARIANT):
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    # rope_theta 10, not Qwen's 1e6: M-RoPE gives the width axis the lowest frequencies, and at a large theta
    # the 6 columns of a scene's token grid would rotate by under 0.02 rad, leaving the language model blind
    # to left / right (position questions stayed at chance). At 10 they span 0.5-1.2 rad (demo-large's 16
    # columns: 1.6-3.6 rad, still short of a turn); prompts are short.
    text = dict(vocab_size=640, hidden_size=256, intermediate_size=704, num_hidden_layers=variant.text_layers,
                num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10.0, "mrope_section": [8, 12, 12]},
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], tie_word_embeddings=True)
    vision = dict(depth=variant.vision_depth, embed_dim=192, hidden_size=256, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                         video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                         vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)


class Batcher:
    """Chat-formatted examples -> padded model inputs; loss only on the answer and its end-of-turn token."""

    def __init__(self, tokenizer, image_token_id: int, scenes: SceneProfile = DEMO) -> None:
        self.tok = tokenizer
        self.image_token_id = image_token_id
        self.scenes = scenes
        pixels = scenes.image_size * scenes.image_size
        self.proc = QwenImageProcessor.from_config(qwen_preprocessor_config(pixels, pixels))
        grid = self.proc.grid_thw(scenes.image_size, scenes.image_size)
        self.num_image_tokens = self.proc.num_image_tokens(grid)
        self.patches_per_image = grid[0] * grid[1] * grid[2]
        merge = self.proc.merge_size
        self.merged_grid = (grid[0], grid[1] // merge, grid[2] // merge)
        self.pad = tokenizer.pad_token_id

    def prompt_ids(self, question: str) -> list[int]:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tok.encode(text, add_special_tokens=False)
        k = ids.index(self.image_token_id)
        return ids[:k] + [self.image_token_id] * self.num_image_tokens + ids[k + 1:]

    def __call__(self, examples, device: str, raw_pixels: bool = False) -> dict:
        """raw_pixels: hand over the scenes as one uint8 tensor ("images_u8") for `pixel_values` to finish on
        the GPU, instead of float pixel_values: a quarter of the bytes through the loader's shared memory and
        pinned copies, which bound the step rate of a 256-scene batch."""
        rows, labels, pixels, grids = [], [], [], []
        for ex in examples:
            prompt = self.prompt_ids(ex.question)
            answer = self.tok.encode(ex.answer + "<|im_end|>", add_special_tokens=False)
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
            pv, grid = (self.proc.preprocess_compact if raw_pixels else self.proc.preprocess)(ex.image)
            pixels.append(pv)
            grids.append(grid)
        width = max(map(len, rows))
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        lab = torch.full((len(rows), width), -100, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        # M-RoPE positions computed here (in the loader's workers) rather than by transformers, whose per-row
        # loop syncs the GPU every step; padding positions are masked out and carry no loss.
        positions = torch.zeros((3, len(rows), width), dtype=torch.long)
        for i, (r, lb) in enumerate(zip(rows, labels)):
            ids[i, : len(r)], lab[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), torch.tensor(lb), 1
            k = r.index(self.image_token_id)
            positions[:, i, : len(r)] = mrope_positions(len(r), [(k, k + self.num_image_tokens, *self.merged_grid,
                                                                   "scene")])[0]
        batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": lab.to(device),
                 "position_ids": positions.to(device), "image_grid_thw": torch.tensor(grids, device=device),
                 "mm_token_type_ids": (ids == self.image_token_id).long().to(device)}
        if raw_pixels:
            batch["images_u8"] = torch.stack(pixels).to(device)
        else:
            batch["pixel_values"] = torch.cat(pixels).to(device)
        return batch

    def pixel_values(self, images_u8: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) uint8 scenes of the processor's own size -> their pixel_values, where the images are. The
        scenes stacked into one tall image patchify, merge window by merge window, into each scene's rows in turn:
        the processor's own compact decode gives what it gives each scene, in one call."""
        b, h, w, c = images_u8.shape
        return self.proc.decode_compact(images_u8.reshape(b * h, w, c))


def answer_correct(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Teacher-forced exact match per row: every answer token predicted right (a fast proxy for greedy accuracy)."""
    pred = logits[:, :-1].argmax(-1)
    gold = labels[:, 1:]
    return ((pred == gold) | (gold == -100)).all(dim=1)


class StepBatches(torch.utils.data.Dataset):
    """Batch `i` of the training stream, built from its step index alone: the data order is fixed by the seed
    whatever the number of loader workers, and workers take image drawing and preprocessing off the GPU's path."""

    def __init__(self, batcher: Batcher, seed: int, steps: int, batch_size: int) -> None:
        self.batcher, self.seed, self.steps, self.batch_size = batcher, seed, steps, batch_size

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int) -> dict:
        start = step * self.batch_size
        scenes = self.batcher.scenes
        return self.batcher([make_example(self.seed, start + i, scenes) for i in range(self.batch_size)], "cpu",
                            raw_pixels=True)


def batch_vision_attention(model, patches_per_image: int) -> None:
    """Make the transformers model's vision attention one SDPA call over all images of a batch.

    transformers runs it image by image (a host sync and a kernel per image, per layer, forward and backward:
    the bulk of a training step for this small model). Every scene has the same size, so the images' patches
    form equal segments and one batched call computes the same per-image attention. Training-time only: the
    saved checkpoint does not change."""
    import torch.nn.functional as F
    from transformers.models.qwen2_vl import modeling_qwen2_vl as hf

    for module in model.modules():
        if not isinstance(module, hf.VisionAttention):
            continue

        def forward(hidden_states, cu_seqlens, position_embeddings=None, max_seqlen=None, _m=module,
                    _original=module.forward, **kwargs):
            n = hidden_states.shape[0]
            if n % patches_per_image:
                return _original(hidden_states, cu_seqlens, position_embeddings, max_seqlen, **kwargs)
            q, k, v = _m.qkv(hidden_states).reshape(n, 3, _m.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
            q, k = hf.apply_rotary_pos_emb_vision(q, k, *position_embeddings)
            images = n // patches_per_image
            _m.batched_attention_calls += 1

            def split(x: torch.Tensor) -> torch.Tensor:  # (n, heads, dim) -> (images, heads, patches, dim)
                return x.reshape(images, patches_per_image, _m.num_heads, -1).transpose(1, 2)

            out = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=_m.scaling)
            return _m.proj(out.transpose(1, 2).reshape(n, -1))

        module.forward = forward
        module.batched_attention_calls = 0


def _one_thread(_: int) -> None:
    torch.set_num_threads(1)  # many loader processes, each with a thread per core, would oversubscribe the CPU


def train(out: str, steps: int, batch_size: int, lr: float, seed: int, device: str, log_every: int = 100,
          workers: int = 0, validate: bool = True, max_seconds: float | None = None,
          init_from: str | None = None, schedule_steps: int | None = None, untimed_steps: int = 5,
          variant: str = "demo", val_examples: int = 512) -> dict:
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    spec = demo_variant(variant)
    torch.manual_seed(seed)
    tokenizer = demo_tokenizer()
    config = demo_config(tokenizer, spec)
    parent_recipe = None  # the recipe of the run continued from, so the chain can be repeated
    if init_from is None:
        model = Qwen2VLForConditionalGeneration(config)
    else:  # continue from an earlier run's checkpoint (weights only: a fresh optimizer and schedule)
        model = Qwen2VLForConditionalGeneration.from_pretrained(init_from, dtype=torch.float32)
        shape = (model.config.vision_config.depth, model.config.text_config.num_hidden_layers)
        if shape != (spec.vision_depth, spec.text_layers):
            raise ValueError(f"{init_from} has {shape[0]} vision and {shape[1]} language-model layers; the "
                             f"{spec.name} variant has {spec.vision_depth} and {spec.text_layers}")
        # Read now, not after training: a folder without one must not fail the run at its end.
        recipe_file = Path(init_from) / "training.json"
        parent_recipe = json.loads(recipe_file.read_text()) if recipe_file.exists() else None
    model = model.to(device).train()
    batcher = Batcher(tokenizer, config.image_token_id, spec.scenes)
    batch_vision_attention(model, batcher.patches_per_image)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    horizon = schedule_steps or steps  # the cosine schedule's length (longer than `steps`: a run cut short)
    warmup = max(1, horizon // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / horizon))))
    if validate:  # no random draws: skipping it (a timing probe) leaves the training stream as it is
        val_split = make_split("validation", val_examples, profile=spec.scenes)
        val = batcher(val_split, device, raw_pixels=True)  # finished where the model is: 512 large scenes take
        val["pixel_values"] = batcher.pixel_values(val.pop("images_u8"))  # ~15 s on 2 CPU cores, ms on a GPU
        val_types = [ex.qtype for ex in val_split]
    loader = torch.utils.data.DataLoader(StepBatches(batcher, seed, steps, batch_size), batch_size=None,
                                         num_workers=workers, prefetch_factor=PREFETCH if workers else None,
                                         pin_memory=device.startswith("cuda"), worker_init_fn=_one_thread)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else torch.autocast(
        "cpu", enabled=False)
    t0, log = time.time(), []
    warm_steps, t_warm = min(untimed_steps, steps // 2), None
    stopped_at = None
    for step, batch in enumerate(loader):
        if max_seconds is not None and time.time() - t0 > max_seconds:
            stopped_at = step  # a safety stop (the schedule assumed `steps`): recorded, never silent
            print(json.dumps({"stopped_early_at_step": step}), flush=True)
            break
        if step == warm_steps:
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t_warm = time.time()
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        batch["pixel_values"] = batcher.pixel_values(batch.pop("images_u8"))
        with autocast:
            loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if validate and ((step + 1) % log_every == 0 or step + 1 == steps):
            model.eval()
            with torch.no_grad(), autocast:
                ok = answer_correct(model(**val).logits, val["labels"]).tolist()
            model.train()
            per_type = {t: round(sum(o for o, q in zip(ok, val_types) if q == t) / val_types.count(t), 4)
                        for t in QUESTION_TYPES}
            log.append({"step": step + 1, "loss": round(loss.item(), 4), "val_exact": round(sum(ok) / len(ok), 4),
                        "val_by_type": per_type, "seconds": round(time.time() - t0, 1)})
            print(json.dumps(log[-1]), flush=True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    done = stopped_at if stopped_at is not None else steps
    seconds_per_step = (time.time() - t_warm) / max(1, done - warm_steps) if t_warm else float("nan")
    model.eval()
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)  # bf16 keeps the shipped checkpoint small
    model.generation_config = GenerationConfig(eos_token_id=[config.text_config.eos_token_id],
                                               pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(qwen_preprocessor_config(spec.pixels, spec.pixels),
                                                              indent=1))
    meta = {"variant": spec.name, "scenes": spec.scenes.name, "steps": steps, "schedule_steps": horizon,
            "batch_size": batch_size, "lr": lr, "seed": seed, "device": device,
            "question_types": list(QUESTION_TYPES), "train_seconds": time.time() - t0,
            "seconds_per_step": seconds_per_step, "stopped_early_at_step": stopped_at, "init_from": parent_recipe,
            "log": log}
    (path / "training.json").write_text(json.dumps(meta, indent=1))
    return meta


def steps_for_budget(seconds: float, batch_size: int, lr: float, seed: int, device: str, workers: int,
                     timed_steps: int = 20, variant: str = "demo") -> int:
    """How many steps fit in `seconds` on this machine, from a short timed probe run (thrown away). The
    chosen count is recorded in training.json: retraining with `--steps N` reproduces the run exactly.

    The probe times only steps after the loader's prefetched batches are used up: a small model's step can
    outrun scene drawing, and timing the prefetched start once promised 0.08 s/step for a run that then
    took 0.13 (data-bound) and hit its safety stop before the schedule ended."""
    import tempfile

    untimed = 2 * PREFETCH * workers + 5
    with tempfile.TemporaryDirectory() as tmp:
        meta = train(tmp, untimed + timed_steps, batch_size, lr, seed, device, log_every=untimed + timed_steps,
                     workers=workers, validate=False, untimed_steps=untimed, variant=variant)
    per_step = meta["seconds_per_step"]
    steps = max(1, int(seconds / per_step))
    print(json.dumps({"probe_seconds_per_step": round(per_step, 4), "steps": steps}), flush=True)
    return steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--variant", default="demo", choices=sorted(VARIANTS),
                   help="which demo model: its scenes, its size and the defaults of --steps, --batch-size, --lr, "
                        "--max-seconds, --seed and --init-from (flashvlm/demo/variants.py)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="instead of --steps: time a short probe, then train as many steps as fit in this many "
                        "seconds (the count is printed and saved in training.json)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--lr", type=float, default=None,
                   help="peak AdamW learning rate (1e-3 and above stall at the answer prior on this model)")
    p.add_argument("--seed", type=int, default=None, help="seeds weights and data order (the variant's recipe: demo 0, "
                   "demo-large 2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this earlier checkpoint's weights (a folder, or a demo model's name; its "
                        "training.json is kept in the new one); give another --seed so the run sees new scenes. "
                        "Default: the variant's recipe (demo-large starts from demo); 'none' trains from scratch")
    p.add_argument("--schedule-steps", type=int, default=None,
                   help="length of the learning-rate schedule if not --steps (to repeat a run that a safety stop "
                        "cut short: --steps STOPPED_AT --schedule-steps STEPS, both in its training.json)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="safety stop: end training after this many seconds and save what there is (recorded)")
    p.add_argument("--workers", type=int, default=min(8, max(0, (os.cpu_count() or 1) - 2)),
                   help="data-loader processes drawing and preprocessing scenes (the data order does not depend on it)")
    args = p.parse_args(argv)
    recipe = VARIANTS[args.variant].recipe
    for flag, default in (("steps", recipe.steps), ("batch_size", recipe.batch_size), ("lr", recipe.lr),
                          ("max_seconds", recipe.max_seconds), ("seed", recipe.seed), ("init_from", recipe.init_from)):
        if getattr(args, flag) is None:
            setattr(args, flag, default)
    args.init_from = None if args.init_from == "none" else args.init_from
    if args.init_from is not None:
        try:
            args.init_from = resolve_model(args.init_from)
        except FileNotFoundError as e:
            p.error(str(e))
        if not (Path(args.init_from) / "config.json").is_file():
            p.error(f"--init-from {args.init_from}: not a checkpoint folder (no config.json)")
    if args.steps < 1 or args.batch_size < 1 or args.lr < 0:
        p.error("--steps and --batch-size must be >= 1 and --lr >= 0")
    if args.schedule_steps is not None and args.schedule_steps < args.steps:
        p.error(f"--schedule-steps ({args.schedule_steps}) must be at least --steps ({args.steps})")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        p.error("--time-budget-s must be positive")
    if args.time_budget_s is not None:
        args.steps = steps_for_budget(args.time_budget_s, args.batch_size, args.lr, args.seed, args.device,
                                      args.workers, variant=args.variant)
    train(args.out, args.steps, args.batch_size, args.lr, args.seed, args.device, args.log_every, args.workers,
          max_seconds=args.max_seconds, init_from=args.init_from, schedule_steps=args.schedule_steps,
          variant=args.variant)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
