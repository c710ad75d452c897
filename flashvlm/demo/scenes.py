"""Synthetic visual question answering: scenes of coloured shapes and small printed text, with short exact
answers. Every split is made on the fly from a seed, so train / validation / test never need files.

Two profiles draw the same questions: `DEMO` (168x168, the embedded model's) and `DEMO_LARGE` (448x448: the
same shapes and print, sparse on a plain background, so most of a picture's image tokens are redundant).

Question types (each with its own accuracy in `flashvlm eval`):
- colour:   "What colour is the triangle?"            -> "red"
- count:    "How many shapes are there?"              -> "3"
- position: "Is the red circle left or right of the blue square?" -> "left"
- text:     "What number is written in the box?"      -> "47"   (fine detail, like reading a screenshot)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
           "purple": (140, 60, 180), "orange": (240, 130, 20)}
SHAPES = ("circle", "square", "triangle")
WORDS = ("cat", "dog", "sun", "box", "red", "map", "key", "car", "pen", "cup")
QUESTION_TYPES = ("colour", "count", "position", "text")
SPLIT_SEEDS = {"train": 0, "validation": 1_000_003, "test": 2_000_003}


@dataclass(frozen=True)
class SceneProfile:
    """How a family of scenes is drawn. Shapes sit in the cells of a grid x grid grid, each inside its own cell,
    so left/right/above/below are unambiguous."""

    name: str
    image_size: int
    grid: int
    shape_pad: tuple[int, int]  # a shape's margin to its cell's edges, px (drawn from this range)
    shape_jitter: int  # most px a shape moves off its cell's centre, each axis (0: centred, nothing drawn)
    distractor_size: int  # the dots drawn around a text question's box, px
    max_distractors: int
    glyph_scale: int  # the bitmap font's pixels are drawn as glyph_scale x glyph_scale blocks

    @property
    def cell(self) -> int:
        return self.image_size // self.grid


DEMO = SceneProfile("demo", image_size=168, grid=3, shape_pad=(8, 14), shape_jitter=0, distractor_size=14,
                    max_distractors=2, glyph_scale=2)
# 448 = 16 merged tokens of 28 px a side: 256 image tokens. Shapes and print are the size they are in DEMO
# (36-56 px shapes, 12x22 px glyphs), so at most ~45 of the 256 tokens hold anything but background.
DEMO_LARGE = SceneProfile("demo-large", image_size=448, grid=4, shape_pad=(28, 38), shape_jitter=20,
                          distractor_size=24, max_distractors=3, glyph_scale=2)
PROFILES = {p.name: p for p in (DEMO, DEMO_LARGE)}
IMAGE_SIZE = DEMO.image_size
GRID = DEMO.grid
CELL = DEMO.cell


def scene_profile(name: str) -> SceneProfile:
    if name not in PROFILES:
        raise ValueError(f"unknown scene profile {name!r}; choose from {sorted(PROFILES)}")
    return PROFILES[name]


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    row: int
    col: int


@dataclass
class Example:
    image: Image.Image
    question: str
    answer: str
    qtype: str


def _draw_shape(draw: ImageDraw.ImageDraw, s: Shape, rng: random.Random, profile: SceneProfile) -> None:
    pad, cell = rng.randint(*profile.shape_pad), profile.cell
    # Jitter only where asked: DEMO's scenes (its random stream) stay exactly as its model was trained on.
    j = profile.shape_jitter
    dx, dy = (rng.randint(-j, j), rng.randint(-j, j)) if j else (0, 0)
    x0, y0 = s.col * cell + pad + dx, s.row * cell + pad + dy
    x1, y1 = (s.col + 1) * cell - pad + dx, (s.row + 1) * cell - pad + dy
    fill = COLOURS[s.colour]
    if s.kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif s.kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=fill)


def _background(rng: random.Random, profile: SceneProfile) -> Image.Image:
    base = tuple(rng.randint(225, 250) for _ in range(3))
    return Image.new("RGB", (profile.image_size, profile.image_size), base)


def _shape_scene(rng: random.Random, n: int, profile: SceneProfile) -> tuple[Image.Image, list[Shape]]:
    cells = rng.sample([(r, c) for r in range(profile.grid) for c in range(profile.grid)], n)
    shapes = [Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), r, c) for r, c in cells]
    img = _background(rng, profile)
    draw = ImageDraw.Draw(img)
    for s in shapes:
        _draw_shape(draw, s, rng, profile)
    return img, shapes


def _name(s: Shape) -> str:
    return f"{s.colour} {s.kind}"


def _colour_question(rng: random.Random, profile: SceneProfile) -> Example:
    while True:
        img, shapes = _shape_scene(rng, rng.randint(1, 4), profile)
        kinds = [s.kind for s in shapes]
        unique = [s for s in shapes if kinds.count(s.kind) == 1]
        if unique:
            target = rng.choice(unique)
            return Example(img, f"What colour is the {target.kind}?", target.colour, "colour")


def _count_question(rng: random.Random, profile: SceneProfile) -> Example:
    img, shapes = _shape_scene(rng, rng.randint(1, 5), profile)
    if rng.random() < 0.5:
        return Example(img, "How many shapes are there?", str(len(shapes)), "count")
    kind = rng.choice(SHAPES)
    return Example(img, f"How many {kind}s are there?", str(sum(s.kind == kind for s in shapes)), "count")


def _position_question(rng: random.Random, profile: SceneProfile) -> Example:
    while True:
        img, shapes = _shape_scene(rng, rng.randint(2, 4), profile)
        names = [_name(s) for s in shapes]
        a, b = rng.sample(shapes, 2)
        if names.count(_name(a)) > 1 or names.count(_name(b)) > 1:
            continue  # a name must pick out one shape
        if a.col != b.col and (a.row == b.row or rng.random() < 0.5):
            answer = "left" if a.col < b.col else "right"
            return Example(img, f"Is the {_name(a)} left or right of the {_name(b)}?", answer, "position")
        if a.row != b.row:
            answer = "above" if a.row < b.row else "below"
            return Example(img, f"Is the {_name(a)} above or below the {_name(b)}?", answer, "position")


GLYPH_SCALE = DEMO.glyph_scale  # the bitmap font (6x11 px a glyph) drawn at 2x: 12x22 px, about one ViT patch
# Pillow's built-in bitmap font (not its default FreeType font, which varies with the build): the same pixels
# wherever the scenes are drawn, so a model trained on one machine is evaluated on the same images elsewhere.
_FONT = ImageFont.load_default_imagefont() if hasattr(ImageFont, "load_default_imagefont") else ImageFont.load_default()


def render_text(text: str, scale: int) -> Image.Image:
    """`text` in the bitmap font as an "L" mask (255 = ink), each font pixel a scale x scale block."""
    w, h = 6 * len(text) + 2, 12
    glyphs = Image.new("L", (w, h), 255)
    ImageDraw.Draw(glyphs).text((1, 0), text, fill=0, font=_FONT)
    glyphs = glyphs.resize((w * scale, h * scale), Image.NEAREST)
    return Image.eval(glyphs, lambda v: 255 - v)


def _text_question(rng: random.Random, profile: SceneProfile) -> Example:
    img = _background(rng, profile)
    if rng.random() < 0.5:
        text, question = str(rng.randint(0, 99)), "What number is written in the box?"
    else:
        text, question = rng.choice(WORDS), "What word is written in the box?"
    # Screenshot-sized print: each glyph spans about one 14-px patch, so reading it needs each patch's detail.
    ink = render_text(text, profile.glyph_scale)
    size, dot = profile.image_size, profile.distractor_size
    x = rng.randint(6, size - ink.width - 6)
    y = rng.randint(6, size - ink.height - 6)
    img.paste((0, 0, 0), (x, y), ink)
    draw = ImageDraw.Draw(img)
    draw.rectangle((x - 4, y - 4, x + ink.width + 3, y + ink.height + 3), outline=(0, 0, 0), width=1)
    # Distractor shapes away from the box, so the text is not alone in the picture.
    for _ in range(rng.randint(0, profile.max_distractors)):
        cx, cy = rng.randint(0, size - dot - 6), rng.randint(0, size - dot - 6)
        if cx + dot < x - 6 or cx > x + ink.width + 6 or cy + dot < y - 6 or cy > y + ink.height + 6:
            draw.ellipse((cx, cy, cx + dot, cy + dot), fill=COLOURS[rng.choice(list(COLOURS))])
    return Example(img, question, text, "text")


_MAKERS = {"colour": _colour_question, "count": _count_question, "position": _position_question,
           "text": _text_question}


def make_example(seed: int, index: int, profile: SceneProfile = DEMO) -> Example:
    """Example `index` of the split with this seed; question types cycle so every type is equally common."""
    rng = random.Random(seed * 1_000_003 + index)
    return _MAKERS[QUESTION_TYPES[index % len(QUESTION_TYPES)]](rng, profile)


def make_split(split: str, n: int, offset: int = 0, profile: SceneProfile = DEMO) -> list[Example]:
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose from {sorted(SPLIT_SEEDS)}")
    return [make_example(SPLIT_SEEDS[split], offset + i, profile) for i in range(n)]


def answer_vocabulary() -> list[str]:
    """Every answer the generator can produce (for the tokenizer's corpus)."""
    return sorted(set(COLOURS) | {str(i) for i in range(100)} | {"left", "right", "above", "below"} | set(WORDS))
