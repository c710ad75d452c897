"""Synthetic visual question answering: scenes of coloured shapes and small printed text, with short exact
answers. Every split is made on the fly from a seed, so train / validation / test never need files.

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

IMAGE_SIZE = 168
GRID = 3  # shapes sit in the cells of a 3x3 grid, so left/right/above/below are unambiguous
CELL = IMAGE_SIZE // GRID
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30),
           "purple": (140, 60, 180), "orange": (240, 130, 20)}
SHAPES = ("circle", "square", "triangle")
WORDS = ("cat", "dog", "sun", "box", "red", "map", "key", "car", "pen", "cup")
QUESTION_TYPES = ("colour", "count", "position", "text")
SPLIT_SEEDS = {"train": 0, "validation": 1_000_003, "test": 2_000_003}


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


def _draw_shape(draw: ImageDraw.ImageDraw, s: Shape, rng: random.Random) -> None:
    pad = rng.randint(8, 14)
    x0, y0 = s.col * CELL + pad, s.row * CELL + pad
    x1, y1 = (s.col + 1) * CELL - pad, (s.row + 1) * CELL - pad
    fill = COLOURS[s.colour]
    if s.kind == "circle":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
    elif s.kind == "square":
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    else:
        draw.polygon([(x0, y1), ((x0 + x1) // 2, y0), (x1, y1)], fill=fill)


def _background(rng: random.Random) -> Image.Image:
    base = tuple(rng.randint(225, 250) for _ in range(3))
    return Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), base)


def _shape_scene(rng: random.Random, n: int) -> tuple[Image.Image, list[Shape]]:
    cells = rng.sample([(r, c) for r in range(GRID) for c in range(GRID)], n)
    shapes = [Shape(rng.choice(SHAPES), rng.choice(list(COLOURS)), r, c) for r, c in cells]
    img = _background(rng)
    draw = ImageDraw.Draw(img)
    for s in shapes:
        _draw_shape(draw, s, rng)
    return img, shapes


def _name(s: Shape) -> str:
    return f"{s.colour} {s.kind}"


def _colour_question(rng: random.Random) -> Example:
    while True:
        img, shapes = _shape_scene(rng, rng.randint(1, 4))
        kinds = [s.kind for s in shapes]
        unique = [s for s in shapes if kinds.count(s.kind) == 1]
        if unique:
            target = rng.choice(unique)
            return Example(img, f"What colour is the {target.kind}?", target.colour, "colour")


def _count_question(rng: random.Random) -> Example:
    img, shapes = _shape_scene(rng, rng.randint(1, 5))
    if rng.random() < 0.5:
        return Example(img, "How many shapes are there?", str(len(shapes)), "count")
    kind = rng.choice(SHAPES)
    return Example(img, f"How many {kind}s are there?", str(sum(s.kind == kind for s in shapes)), "count")


def _position_question(rng: random.Random) -> Example:
    while True:
        img, shapes = _shape_scene(rng, rng.randint(2, 4))
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


GLYPH_SCALE = 2  # the bitmap font (6x11 px a glyph) drawn at 2x: 12x22 px, about one ViT patch per glyph
# Pillow's built-in bitmap font (not its default FreeType font, which varies with the build): the same pixels
# wherever the scenes are drawn, so a model trained on one machine is evaluated on the same images elsewhere.
_FONT = ImageFont.load_default_imagefont() if hasattr(ImageFont, "load_default_imagefont") else ImageFont.load_default()


def _text_question(rng: random.Random) -> Example:
    img = _background(rng)
    if rng.random() < 0.5:
        text, question = str(rng.randint(0, 99)), "What number is written in the box?"
    else:
        text, question = rng.choice(WORDS), "What word is written in the box?"
    # Screenshot-sized print: each glyph spans about one 14-px patch, so reading it needs each patch's detail.
    w, h = 6 * len(text) + 2, 12
    glyphs = Image.new("L", (w, h), 255)
    ImageDraw.Draw(glyphs).text((1, 0), text, fill=0, font=_FONT)
    glyphs = glyphs.resize((w * GLYPH_SCALE, h * GLYPH_SCALE), Image.NEAREST)
    x = rng.randint(6, IMAGE_SIZE - glyphs.width - 6)
    y = rng.randint(6, IMAGE_SIZE - glyphs.height - 6)
    img.paste((0, 0, 0), (x, y), Image.eval(glyphs, lambda v: 255 - v))
    draw = ImageDraw.Draw(img)
    draw.rectangle((x - 4, y - 4, x + glyphs.width + 3, y + glyphs.height + 3), outline=(0, 0, 0), width=1)
    # Distractor shapes away from the box, so the text is not alone in the picture.
    for _ in range(rng.randint(0, 2)):
        cx, cy = rng.randint(0, IMAGE_SIZE - 20), rng.randint(0, IMAGE_SIZE - 20)
        if cx + 14 < x - 6 or cx > x + glyphs.width + 6 or cy + 14 < y - 6 or cy > y + glyphs.height + 6:
            draw.ellipse((cx, cy, cx + 14, cy + 14), fill=COLOURS[rng.choice(list(COLOURS))])
    return Example(img, question, text, "text")


_MAKERS = {"colour": _colour_question, "count": _count_question, "position": _position_question,
           "text": _text_question}


def make_example(seed: int, index: int) -> Example:
    """Example `index` of the split with this seed; question types cycle so every type is equally common."""
    rng = random.Random(seed * 1_000_003 + index)
    return _MAKERS[QUESTION_TYPES[index % len(QUESTION_TYPES)]](rng)


def make_split(split: str, n: int, offset: int = 0) -> list[Example]:
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; choose from {sorted(SPLIT_SEEDS)}")
    return [make_example(SPLIT_SEEDS[split], offset + i) for i in range(n)]


def answer_vocabulary() -> list[str]:
    """Every answer the generator can produce (for the tokenizer's corpus)."""
    return sorted(set(COLOURS) | {str(i) for i in range(100)} | {"left", "right", "above", "below"} | set(WORDS))
