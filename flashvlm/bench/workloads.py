"""Seeded synthetic workloads, custom JSONL datasets, and request arrival processes for the benchmarks.

Everything is deterministic given a seed: the same WorkloadSpec yields identical prompts, token budgets and
image pixels, so two engines (or two commits) are measured on exactly the same inputs.

Image sizes are (height, width) tuples in code; on the command line they are written WIDTHxHEIGHT, the usual
way to write a resolution ("1008x756" is a landscape 4:3 picture, stored as (756, 1008)).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flashvlm.bench.records import BenchRequest

IntRange = int | tuple[int, int]
"""A fixed count, or an inclusive (lo, hi) range sampled uniformly per request."""

DEFAULT_WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "as", "with",
    "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but", "not", "what",
    "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each", "which", "she", "do",
    "how", "their", "if", "will", "up", "other", "about", "out", "many", "then", "them", "these", "so", "some",
    "her", "would", "make", "like", "him", "into", "time", "has", "look", "two", "more", "write", "go", "see",
    "number", "no", "way", "could", "people", "my", "than", "first", "water", "been", "call", "who", "its",
    "now", "find", "long", "down", "day", "did", "get", "come", "made", "may", "part", "red", "blue", "green",
)
"""Common short English words: with BPE tokenizers each is one token after a space, so N words ~ N tokens."""


def _bounds(value: IntRange) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _check_range(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or a (lo, hi) pair, got {value!r}")
    if isinstance(value, int):
        lo = hi = value
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        lo, hi = value
    else:
        raise ValueError(f"{name} must be an int or a (lo, hi) pair of ints, got {value!r}")
    if lo < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if lo > hi:
        raise ValueError(f"{name} range {value!r} has lo > hi")


def parse_image_size(text: str) -> tuple[int, int]:
    """'1008x756' (WIDTHxHEIGHT) -> (756, 1008) as (height, width)."""
    parts = text.strip().lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"image size {text!r} is not WIDTHxHEIGHT, e.g. 1008x756")
    w, h = int(parts[0]), int(parts[1])
    if w <= 0 or h <= 0:
        raise ValueError(f"image size {text!r} must have positive width and height")
    return h, w


def format_image_size(size: tuple[int, int]) -> str:
    """(height, width) -> 'WIDTHxHEIGHT', the inverse of parse_image_size."""
    return f"{size[1]}x{size[0]}"


def parse_image_mix(text: str) -> tuple[list[tuple[int, int]], list[float] | None]:
    """'448x448:0.5,1008x756:0.3,1344x1344:0.2' -> sizes and probabilities; without ':p' parts ('448x448' or
    '448x448,1008x756') the probabilities are None, meaning uniform."""
    sizes: list[tuple[int, int]] = []
    probs: list[float] = []
    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        raise ValueError("empty image size list")
    for item in items:
        size, sep, prob = item.partition(":")
        sizes.append(parse_image_size(size))
        if sep:
            try:
                probs.append(float(prob))
            except ValueError:
                raise ValueError(f"image mix item {item!r}: {prob!r} is not a probability") from None
    if probs and len(probs) != len(sizes):
        raise ValueError(f"image mix {text!r}: give a probability for every size or for none")
    return sizes, (probs or None)


def parse_int_range(text: str | int) -> IntRange:
    """'64' -> 64, '32-128' -> (32, 128)."""
    if isinstance(text, int):
        return text
    lo, sep, hi = text.strip().partition("-")
    try:
        return (int(lo), int(hi)) if sep else int(lo)
    except ValueError:
        raise ValueError(f"{text!r} is not N or LO-HI") from None


@dataclass
class WorkloadSpec:
    """A synthetic multimodal workload. Sizes are (height, width); ranges are inclusive."""

    num_requests: int = 16
    image_sizes: list[tuple[int, int]] = field(default_factory=lambda: [(448, 448)])
    image_probs: list[float] | None = None
    """Probability of each entry of image_sizes (a bucket mix); None = uniform."""
    images_per_request: IntRange = 1
    text_tokens: IntRange = 64
    output_tokens: IntRange = 64
    repeated_image_ratio: float = 0.0
    """Fraction of all requests whose images are all drawn from earlier requests' images (same key and
    pixels), for cache benchmarks. The first request with images cannot repeat, which caps the ratio."""
    seed: int = 0

    def validate(self) -> WorkloadSpec:
        if isinstance(self.num_requests, bool) or not isinstance(self.num_requests, int) or self.num_requests < 1:
            raise ValueError(f"num_requests must be a positive int, got {self.num_requests!r}")
        _check_range("images_per_request", self.images_per_request, 0)
        _check_range("text_tokens", self.text_tokens, 0)
        _check_range("output_tokens", self.output_tokens, 1)
        max_images = _bounds(self.images_per_request)[1]
        if max_images > 0 and not self.image_sizes:
            raise ValueError("image_sizes is empty but requests have images")
        for size in self.image_sizes:
            if not (isinstance(size, (tuple, list)) and len(size) == 2
                    and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
                raise ValueError(f"image size {size!r} must be a (height, width) pair of positive ints")
        if self.image_probs is not None:
            probs = self.image_probs
            if len(probs) != len(self.image_sizes):
                raise ValueError(f"{len(probs)} image probabilities for {len(self.image_sizes)} image sizes")
            if any(not math.isfinite(p) or p < 0 for p in probs):
                raise ValueError(f"image probabilities must be finite and >= 0, got {probs}")
            if abs(sum(probs) - 1.0) > 1e-6:
                raise ValueError(f"image probabilities must sum to 1, got {probs} (sum {sum(probs):g})")
        if not 0.0 <= self.repeated_image_ratio <= 1.0:
            raise ValueError(f"repeated_image_ratio must be in [0, 1], got {self.repeated_image_ratio}")
        if self.repeated_image_ratio > 0 and max_images == 0:
            raise ValueError("repeated_image_ratio > 0 needs requests with images")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["image_sizes"] = [format_image_size(s) for s in self.image_sizes]
        return d

    @classmethod
    def from_cli(cls, *, num_requests: int = 16, image_size: str | None = "448x448",
                 images_per_request: str | int = 1, text_tokens: str | int = 64, output_tokens: str | int = 64,
                 repeated_image_ratio: float = 0.0, seed: int = 0) -> WorkloadSpec:
        """Build from CLI strings: image_size is one size ('1008x756'), a list, or a mix with probabilities
        ('448x448:0.5,1008x756:0.5'); None means text-only. Counts are 'N' or 'LO-HI'."""
        if image_size is None:
            sizes, probs, per_request = [], None, 0
        else:
            sizes, probs = parse_image_mix(image_size)
            per_request = parse_int_range(images_per_request)
        return cls(num_requests=num_requests, image_sizes=sizes, image_probs=probs,
                   images_per_request=per_request, text_tokens=parse_int_range(text_tokens),
                   output_tokens=parse_int_range(output_tokens), repeated_image_ratio=repeated_image_ratio,
                   seed=seed).validate()


def long_context_stress(num_requests: int = 1, output_tokens: int = 128, seed: int = 0) -> WorkloadSpec:
    """16K text tokens plus one 1344x1344 image per request: the longest prefill the issue asks to stress."""
    return WorkloadSpec(num_requests=num_requests, image_sizes=[(1344, 1344)], images_per_request=1,
                        text_tokens=16384, output_tokens=output_tokens, seed=seed).validate()


def _key_seed(key: str) -> int:
    # A hash, not Python's hash(): it must not change between processes (PYTHONHASHSEED).
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def synthetic_image(key: str, height: int, width: int) -> np.ndarray:
    """A (height, width, 3) uint8 picture fixed by its key: random colour blocks plus noise, so that
    encoders and image hashes see real content (a flat colour would compress and hash trivially)."""
    rng = np.random.default_rng(_key_seed(key))
    block = int(rng.integers(8, 65))
    grid = rng.integers(0, 256, size=(-(-height // block), -(-width // block), 3), dtype=np.uint8)
    img = np.repeat(np.repeat(grid, block, axis=0), block, axis=1)[:height, :width].astype(np.int16)
    img += rng.integers(-24, 25, size=(height, width, 3), dtype=np.int16)
    return np.clip(img, 0, 255).astype(np.uint8)


def make_token_ids(n: int, rng: np.random.Generator | int, vocab_size: int,
                   avoid: Collection[int] = frozenset()) -> list[int]:
    """n token ids uniform over [0, vocab_size) minus `avoid` (special and image tokens), without building the
    whole vocabulary: draw an index among the allowed ids, then step over the avoided ids below it."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    banned = np.unique(np.fromiter((t for t in avoid if 0 <= t < vocab_size), dtype=np.int64))
    allowed = vocab_size - banned.size
    if allowed <= 0:
        raise ValueError("every token id of the vocabulary is in `avoid`")
    draws = np.random.default_rng(rng).integers(0, allowed, size=n)
    # The d-th allowed id is d plus the number of banned ids b_j with b_j - j <= d.
    shifted = banned - np.arange(banned.size)
    return (draws + np.searchsorted(shifted, draws, side="right")).tolist()


def _sample_counts(rng: np.random.Generator, value: IntRange, n: int) -> np.ndarray:
    lo, hi = _bounds(value)
    # Drawn even when lo == hi so a fixed count and an equal range consume the stream alike.
    return rng.integers(lo, hi + 1, size=n)


def _choose_repeats(rng: np.random.Generator, counts: np.ndarray, ratio: float) -> set[int]:
    has_images = counts > 0
    # A request can only repeat if some earlier request brought images; the first one with images cannot.
    earlier = np.concatenate([[False], np.cumsum(has_images)[:-1] > 0])
    eligible = np.flatnonzero(has_images & earlier)
    k = min(int(math.floor(ratio * len(counts) + 0.5)), eligible.size)
    return set(rng.choice(eligible, size=k, replace=False).tolist()) if k else set()


def generate_workload(spec: WorkloadSpec, placeholder: str, vocab_words: Sequence[str] | None = None
                      ) -> list[BenchRequest]:
    """The requests of a spec: images as uint8 arrays (shared objects for repeated keys), the placeholder
    once per image at the start of the prompt, then ~text_tokens random words."""
    spec.validate()
    words = np.asarray(list(vocab_words) if vocab_words else DEFAULT_WORDS)
    if words.size == 0:
        raise ValueError("vocab_words is empty")
    n = spec.num_requests
    rng = np.random.default_rng(spec.seed)
    counts = _sample_counts(rng, spec.images_per_request, n)
    text_lens = _sample_counts(rng, spec.text_tokens, n)
    out_lens = _sample_counts(rng, spec.output_tokens, n)
    repeats = _choose_repeats(rng, counts, spec.repeated_image_ratio)
    probs = None
    if spec.image_probs is not None:
        probs = np.asarray(spec.image_probs, dtype=np.float64)
        probs = probs / probs.sum()

    images: dict[str, np.ndarray] = {}
    pool: list[str] = []  # fresh image keys of earlier requests, the only ones a repeat may draw
    requests = []
    for i in range(n):
        k = int(counts[i])
        if i in repeats:
            picks = rng.choice(len(pool), size=k, replace=k > len(pool))
            keys = [pool[j] for j in picks]
        else:
            keys = []
            for _ in range(k):
                h, w = spec.image_sizes[int(rng.choice(len(spec.image_sizes), p=probs))]
                key = f"syn-s{spec.seed}-{len(images)}-{w}x{h}"
                images[key] = synthetic_image(key, h, w)
                keys.append(key)
        text = " ".join(rng.choice(words, size=int(text_lens[i])).tolist())
        requests.append(BenchRequest(request_id=f"req-{i:05d}", prompt=placeholder * k + text,
                                     images=[images[key] for key in keys], max_tokens=int(out_lens[i]),
                                     image_keys=keys))
        if i not in repeats:
            pool.extend(keys)
    return requests


def jsonl_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSONL file, read lazily (a caller may stop early);
    ValueError naming `path:line` for a line that is not a JSON object."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
            yield lineno, obj


def resolve_dataset_image(dataset: Path, image: str, where: str) -> str:
    """The absolute path of an image named on a line of a JSONL dataset: `~` expanded, a relative path taken
    against the dataset file's folder. ValueError (starting with `where`) if no such file exists."""
    img = Path(image).expanduser()
    img = img if img.is_absolute() else dataset.parent / img
    if not img.is_file():
        raise ValueError(f"{where}: image {image!r} not found (looked at {img})")
    return str(img.resolve())


def load_jsonl(path: str | Path, default_max_tokens: int = 128, placeholder: str | None = None
               ) -> list[BenchRequest]:
    """A custom dataset: one `{"prompt": str, "images": [paths], "max_tokens": int}` object per line
    ("images" and "max_tokens" optional). Relative image paths resolve against the file's folder. With a
    placeholder, prompts that lack it get it once per image at the start; otherwise prompts stay as written."""
    path = Path(path)
    requests: list[BenchRequest] = []
    for lineno, obj in jsonl_objects(path):
        where = f"{path}:{lineno}"
        unknown = sorted(set(obj) - {"prompt", "images", "max_tokens"})
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: prompt, images, max_tokens")
        prompt = obj.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: 'prompt' must be a string")
        paths = obj.get("images", [])
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ValueError(f"{where}: 'images' must be a list of file paths")
        max_tokens = obj.get("max_tokens", default_max_tokens)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{where}: 'max_tokens' must be a positive int, got {max_tokens!r}")
        resolved = [resolve_dataset_image(path, p, where) for p in paths]
        if placeholder and paths and placeholder not in prompt:
            prompt = placeholder * len(paths) + prompt
        requests.append(BenchRequest(request_id=f"jsonl-{lineno}", prompt=prompt, images=resolved,
                                     max_tokens=max_tokens, image_keys=list(resolved)))
    if not requests:
        raise ValueError(f"{path}: no requests in the file")
    return requests


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (seconds, first at 0) of n requests at `request_rate` req/s: Poisson arrivals for
    burstiness 1, otherwise gamma gaps with shape=burstiness and mean 1/rate (vLLM's convention: < 1 is
    burstier, > 1 more regular; the gap variance is 1 / (rate^2 * burstiness)). An infinite rate sends all at 0."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not request_rate > 0:
        raise ValueError(f"request_rate must be positive (or inf), got {request_rate}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    if n == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:
        gaps = rng.exponential(1.0 / request_rate, size=n - 1)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)]).tolist()


def parse_tier_mix(spec: str) -> list[tuple[str, float]]:
    """'gold' -> [('gold', 1.0)]; 'gold:0.2,bronze:0.8' -> the tiers with their fractions (summing to 1)."""
    mix: list[tuple[str, float]] = []
    for part in spec.split(","):
        name, sep, frac = part.strip().partition(":")
        if not name:
            raise ValueError(f"--tier {spec!r}: empty tier name")
        try:
            p = float(frac) if sep else 1.0
        except ValueError:
            raise ValueError(f"--tier {spec!r}: {frac!r} is not a fraction") from None
        if not 0 < p <= 1:
            raise ValueError(f"--tier {spec!r}: fraction of {name!r} must be in (0, 1]")
        mix.append((name, p))
    if len({n for n, _ in mix}) != len(mix):
        raise ValueError(f"--tier {spec!r}: a tier is named twice")
    total = sum(p for _, p in mix)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"--tier {spec!r}: fractions sum to {total:g}, not 1")
    return mix


def assign_tiers(n: int, mix: Sequence[tuple[str, float]], seed: int) -> list[str]:
    """A seeded tier per request, drawn from the mix (the same workload seed gives the same assignment)."""
    rng = random.Random(f"tiers:{seed}")
    names, weights = [m[0] for m in mix], [m[1] for m in mix]
    return rng.choices(names, weights=weights, k=n)
