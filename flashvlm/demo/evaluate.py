"""`flashvlm eval`: exact-match accuracy on a seeded split of the synthetic scenes, per question type.

Any model and engine configuration can be evaluated, so speed-ups that change numerics (visual-token
pruning, FP8/INT8) report their accuracy cost next to their speed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from flashvlm.demo.scenes import DEMO, QUESTION_TYPES, SceneProfile, make_split, scene_profile
from flashvlm.request import SamplingParams


def normalize(text: str) -> str:
    """Trimmed, without trailing (or leading) periods, internal whitespace runs as one space, lowercase."""
    return " ".join(text.strip().strip(".").split()).lower()


def trained_scenes(model_dir: str | Path) -> SceneProfile:
    """The scenes a demo checkpoint was trained on (its training.json's "scenes"); DEMO's for any other folder,
    the embedded model's (trained before the key existed) included."""
    recipe = Path(model_dir) / "training.json"
    if not recipe.is_file():
        return DEMO
    name = json.loads(recipe.read_text()).get("scenes")
    return DEMO if name is None else scene_profile(name)


def evaluate(llm: Any, split: str = "test", num_examples: int = 200, batch_size: int = 64,
             progress: bool = False, scenes: SceneProfile = DEMO,
             mm_processor_kwargs: dict | None = None) -> dict[str, Any]:
    """Greedy answers through `llm.chat`, compared with the generator's answers after trimming and lowering.
    `mm_processor_kwargs` go with every request (e.g. a pruning setting other than the engine's). The result
    counts the pictures' image tokens and how many of them the language model saw."""
    examples = make_split(split, num_examples, profile=scenes)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    correct: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    mistakes = []
    image_tokens = image_tokens_kept = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start:start + batch_size]
        conversations = [[{"role": "user", "content": [{"type": "image", "image": ex.image},
                                                       {"type": "text", "text": ex.question}]}] for ex in chunk]
        outputs = llm.chat(conversations, params, use_tqdm=progress, mm_processor_kwargs=mm_processor_kwargs)
        for ex, out in zip(chunk, outputs):
            total[ex.qtype] += 1
            image_tokens += out.num_image_tokens
            image_tokens_kept += out.num_image_tokens_kept
            if normalize(out.text) == normalize(ex.answer):
                correct[ex.qtype] += 1
            elif len(mistakes) < 10:
                mistakes.append({"question": ex.question, "expected": ex.answer, "got": out.text})
    per_type = {t: {"correct": correct[t], "total": total[t], "accuracy": correct[t] / total[t]}
                for t in QUESTION_TYPES if total[t]}
    n = sum(total.values())
    return {"split": split, "scenes": scenes.name, "num_examples": n,
            "accuracy": sum(correct.values()) / n if n else 0.0, "per_type": per_type,
            "image_tokens": image_tokens, "image_tokens_kept": image_tokens_kept,
            "kept_fraction": image_tokens_kept / image_tokens if image_tokens else 1.0, "sample_mistakes": mistakes}


def format_report(result: dict[str, Any]) -> str:
    lines = [f"{'question type':14} {'correct':>8} {'total':>6} {'accuracy':>9}"]
    for qtype, r in result["per_type"].items():
        lines.append(f"{qtype:14} {r['correct']:8d} {r['total']:6d} {r['accuracy']:9.1%}")
    lines.append(f"{'overall':14} {'':8} {result['num_examples']:6d} {result['accuracy']:9.1%}")
    if result.get("image_tokens"):
        lines.append(f"image tokens the language model saw: {result['image_tokens_kept']:,} of "
                     f"{result['image_tokens']:,} ({result['image_tokens_kept'] / result['image_tokens']:.1%})")
    return "\n".join(lines)
