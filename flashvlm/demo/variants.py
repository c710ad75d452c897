"""The demo models `flashvlm.demo.train` builds: which scenes each sees, how big it is, and its default recipe.

- `demo`: the embedded model (flashvlm/demo/checkpoint): 168x168 scenes, 36 image tokens a picture.
- `demo-large`: 448x448 scenes with the same objects and print, sparse on plain backgrounds: 256 image tokens a
  picture, most of them background, so visual-token pruning has something to remove and something to lose.

A variant's name is also the name `--model` takes for its checkpoint folder (`flashvlm.models.default`).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashvlm.demo.scenes import DEMO, DEMO_LARGE, SceneProfile


@dataclass(frozen=True)
class Recipe:
    """What `python -m flashvlm.demo.train --variant NAME` runs when a flag is not given."""

    steps: int
    batch_size: int
    lr: float
    max_seconds: float | None = None  # the safety stop (recorded in training.json when it fires)


@dataclass(frozen=True)
class DemoVariant:
    name: str
    scenes: SceneProfile
    vision_depth: int
    text_layers: int
    recipe: Recipe

    @property
    def pixels(self) -> int:
        """min = max pixels of its processor: every scene keeps its own size, never resized."""
        return self.scenes.image_size * self.scenes.image_size


# The embedded model's flag defaults (its shipped recipe is the two-stage one of docs/demo.md).
DEMO_VARIANT = DemoVariant("demo", DEMO, vision_depth=4, text_layers=4, recipe=Recipe(3000, 64, 3e-4))

# demo-large: 6.8M parameters (13.6 MB in bf16, at most 15 MB): a vision tower shaped like the shipped model's
# (which reads the same 12x22-px print) and two more language-model layers, for finding and counting among 256
# image tokens. Trained from scratch: the recipe's 15 minutes are the whole cost.
# Step budget, from the shipped model's solo-H200 numbers (training.json, docs/demo.md): 0.091-0.097 s a step
# at batch 256 for 0.69 TFLOP of model work (2.7 GFLOP a scene, forward and backward), 7 TFLOP/s: that step
# is fixed cost (kernel launches, the loader), not arithmetic. A demo-large scene is 30.5 GFLOP (11x: 7x the
# patches, vision attention over 1,024 of them, 4x the language-model tokens, 6 layers not 4), 7.8 TFLOP a
# step: at a conservative 100 TFLOP/s for these narrow bf16 layers, 78 ms, plus the shipped step's whole 0.09
# s as fixed cost: ~0.17 s. The loader draws and batches a 448x448 scene in ~4 ms on one core (4x a 168x168
# one): 12 workers keep up at ~85 ms a step. 4,500 steps x 0.17 s = 765 s of loop and 1.15M scenes (the
# shipped model's two stages saw 1.26M); the 840-s safety stop keeps the run, with model building, the
# validation passes and saving (~40 s), inside 15 minutes should the estimate be up to 10% optimistic.
DEMO_LARGE_VARIANT = DemoVariant("demo-large", DEMO_LARGE, vision_depth=4, text_layers=6,
                                 recipe=Recipe(steps=4500, batch_size=256, lr=5e-4, max_seconds=840.0))

VARIANTS = {v.name: v for v in (DEMO_VARIANT, DEMO_LARGE_VARIANT)}


def demo_variant(name: str) -> DemoVariant:
    if name not in VARIANTS:
        raise ValueError(f"unknown demo model variant {name!r}; choose from {sorted(VARIANTS)}")
    return VARIANTS[name]
