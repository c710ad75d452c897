"""Workloads are deterministic and follow their spec; arrivals hit the requested rate; JSONL loads or says why not."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from flashvlm.bench.workloads import (
    WorkloadSpec,
    arrival_times,
    format_image_size,
    generate_workload,
    load_jsonl,
    long_context_stress,
    make_token_ids,
    parse_image_mix,
    parse_image_size,
    parse_int_range,
    synthetic_image,
)

PH = "<image>"


def _small(**kw: object) -> WorkloadSpec:
    base = dict(num_requests=12, image_sizes=[(32, 48), (64, 64)], images_per_request=(0, 3), text_tokens=(5, 20),
                output_tokens=(1, 9), repeated_image_ratio=0.25, seed=7)
    base.update(kw)
    return WorkloadSpec(**base)  # type: ignore[arg-type]


def _same(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x.request_id, x.prompt, x.max_tokens, x.image_keys) != (y.request_id, y.prompt, y.max_tokens, y.image_keys):
            return False
        if len(x.images) != len(y.images) or not all(np.array_equal(i, j) for i, j in zip(x.images, y.images)):
            return False
    return True


def test_same_seed_same_requests_including_pixels() -> None:
    a, b = generate_workload(_small(), PH), generate_workload(_small(), PH)
    assert _same(a, b)
    assert any(r.images for r in a)


def test_seed_changes_requests() -> None:
    a, c = generate_workload(_small(), PH), generate_workload(_small(seed=8), PH)
    assert not _same(a, c)
    first_a = next(r.images[0] for r in a if r.images)
    first_c = next(r.images[0] for r in c if r.images)
    assert not np.array_equal(first_a, first_c)


def test_synthetic_image_content() -> None:
    img = synthetic_image("k", 50, 70)
    assert img.shape == (50, 70, 3) and img.dtype == np.uint8
    assert np.array_equal(img, synthetic_image("k", 50, 70))
    assert not np.array_equal(img, synthetic_image("k2", 50, 70))
    assert img.std() > 20 and len(np.unique(img.reshape(-1, 3), axis=0)) > 100  # not a flat colour


def test_prompt_layout_and_ranges() -> None:
    spec = _small(num_requests=200, repeated_image_ratio=0.0)
    reqs = generate_workload(spec, PH, vocab_words=["alpha", "beta"])
    seen_counts = set()
    for r in reqs:
        k = len(r.images)
        seen_counts.add(k)
        assert 0 <= k <= 3 and len(r.image_keys) == k
        assert r.prompt.startswith(PH * k) and r.prompt.count(PH) == k
        words = r.prompt[len(PH) * k:].split()
        assert 5 <= len(words) <= 20 and set(words) <= {"alpha", "beta"}
        assert 1 <= r.max_tokens <= 9
        for img, key in zip(r.images, r.image_keys):
            assert img.dtype == np.uint8 and img.shape[:2] in [(32, 48), (64, 64)]
            assert key.endswith(format_image_size(img.shape[:2]))
    assert seen_counts == {0, 1, 2, 3}  # both ends of the inclusive range occur
    assert {r.max_tokens for r in reqs} == set(range(1, 10))
    fixed = generate_workload(_small(images_per_request=2, text_tokens=4, output_tokens=3,
                                     repeated_image_ratio=0.0), PH)
    assert all(len(r.images) == 2 and len(r.prompt[2 * len(PH):].split()) == 4 and r.max_tokens == 3 for r in fixed)


def test_size_mix_frequencies() -> None:
    sizes = [(8, 8), (8, 16), (16, 8)]
    probs = [0.5, 0.3, 0.2]
    n = 3000
    reqs = generate_workload(WorkloadSpec(num_requests=n, image_sizes=sizes, image_probs=probs, text_tokens=0,
                                          output_tokens=1, seed=3), PH)
    shapes = [r.images[0].shape[:2] for r in reqs]
    for size, p in zip(sizes, probs):
        freq = shapes.count(size) / n
        assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n), (size, freq, p)


def test_repeated_image_ratio() -> None:
    n = 100
    reqs = generate_workload(_small(num_requests=n, images_per_request=(1, 2), repeated_image_ratio=0.3), PH)
    seen: dict[str, np.ndarray] = {}
    repeats = 0
    for r in reqs:
        if all(k in seen for k in r.image_keys):
            repeats += 1
            for key, img in zip(r.image_keys, r.images):
                assert np.array_equal(img, seen[key])
        else:
            assert not any(k in seen for k in r.image_keys)  # a fresh request brings only new pictures
        for key, img in zip(r.image_keys, r.images):
            seen.setdefault(key, img)
    assert repeats == 30
    none = generate_workload(_small(num_requests=n, images_per_request=1, repeated_image_ratio=0.0), PH)
    assert len({k for r in none for k in r.image_keys}) == n
    # Distinct keys really are distinct pictures.
    imgs = [r.images[0] for r in none[:10]]
    assert all(not np.array_equal(imgs[i], imgs[j]) for i in range(10) for j in range(i))
    # The first request cannot repeat, so ratio 1 gives n - 1 repeats.
    everything = generate_workload(_small(num_requests=20, images_per_request=1, repeated_image_ratio=1.0), PH)
    assert len({k for r in everything for k in r.image_keys}) == 1


@pytest.mark.parametrize(("kw", "message"), [
    ({"num_requests": 0}, "num_requests"),
    ({"images_per_request": (3, 1)}, "lo > hi"),
    ({"text_tokens": -1}, "text_tokens"),
    ({"output_tokens": 0}, "output_tokens"),
    ({"output_tokens": "8"}, "output_tokens"),
    ({"image_sizes": [(0, 10)]}, "positive"),
    ({"image_probs": [0.5]}, "1 image probabilities for 2"),
    ({"image_probs": [0.5, 0.6]}, "sum to 1"),
    ({"image_probs": [1.5, -0.5]}, ">= 0"),
    ({"repeated_image_ratio": 1.5}, "repeated_image_ratio"),
    ({"images_per_request": 0, "repeated_image_ratio": 0.5}, "needs requests with images"),
])
def test_validate_errors(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _small(**kw).validate()


def test_cli_parsing() -> None:
    assert parse_image_size("1008x756") == (756, 1008)
    assert format_image_size((756, 1008)) == "1008x756"
    assert parse_image_mix("448x448:0.5,1008x756:0.3,1344x1344:0.2") == (
        [(448, 448), (756, 1008), (1344, 1344)], [0.5, 0.3, 0.2])
    assert parse_image_mix("448x448, 1008x756") == ([(448, 448), (756, 1008)], None)
    assert parse_int_range("64") == 64 and parse_int_range("32-128") == (32, 128) and parse_int_range(5) == 5
    for bad in ("1008", "axb", "0x10", "10x10x3"):
        with pytest.raises(ValueError, match="image size"):
            parse_image_size(bad)
    with pytest.raises(ValueError, match="every size or for none"):
        parse_image_mix("448x448:0.5,1008x756")
    with pytest.raises(ValueError, match="LO-HI"):
        parse_int_range("a-b")
    spec = WorkloadSpec.from_cli(num_requests=4, image_size="448x448:0.25,1008x756:0.75", images_per_request="1-2",
                                 text_tokens="10-20", output_tokens=8, repeated_image_ratio=0.5, seed=1)
    assert spec.image_sizes == [(448, 448), (756, 1008)] and spec.image_probs == [0.25, 0.75]
    assert (spec.images_per_request, spec.text_tokens, spec.output_tokens) == ((1, 2), (10, 20), 8)
    assert spec.to_dict()["image_sizes"] == ["448x448", "1008x756"]
    text_only = WorkloadSpec.from_cli(image_size=None)
    assert all(not r.images for r in generate_workload(text_only, PH))
    with pytest.raises(ValueError, match="sum to 1"):
        WorkloadSpec.from_cli(image_size="448x448:0.5,1008x756:0.3")


def test_long_context_stress() -> None:
    spec = long_context_stress()
    assert spec.text_tokens == 16384 and spec.images_per_request == 1 and spec.image_sizes == [(1344, 1344)]
    (req,) = generate_workload(spec, PH)
    assert req.images[0].shape == (1344, 1344, 3) and len(req.prompt[len(PH):].split()) == 16384


def test_make_token_ids() -> None:
    avoid = {0, 1, 2, 5, 9, 100}
    ids = make_token_ids(5000, np.random.default_rng(0), vocab_size=10, avoid=avoid)
    assert len(ids) == 5000 and set(ids) == {3, 4, 6, 7, 8}  # all allowed ids occur, none avoided
    assert make_token_ids(50, 3, 1000) == make_token_ids(50, 3, 1000)
    assert make_token_ids(0, 0, 10) == []
    with pytest.raises(ValueError, match="every token id"):
        make_token_ids(1, 0, 3, avoid={0, 1, 2})


@pytest.mark.parametrize(("rate", "burstiness"), [(5.0, 1.0), (20.0, 0.5), (2.0, 4.0)])
def test_arrival_rate_and_dispersion(rate: float, burstiness: float) -> None:
    n = 4001
    times = np.asarray(arrival_times(n, rate, burstiness, seed=11))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    gaps = np.diff(times)
    mean, k = 1 / rate, burstiness
    var = mean**2 / k  # gamma with shape k and mean 1/rate
    assert abs(gaps.mean() - mean) < 5 * math.sqrt(var / gaps.size)
    # Sampling std of the sample variance for gamma(k, theta): theta^2 * sqrt((2k^2 + 6k) / n).
    theta = mean / k
    assert abs(gaps.var(ddof=1) - var) < 5 * theta**2 * math.sqrt((2 * k * k + 6 * k) / gaps.size)


def test_arrival_edge_cases() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(0, 1.0) == []
    assert arrival_times(3, 2.0, seed=1) == arrival_times(3, 2.0, seed=1) != arrival_times(3, 2.0, seed=2)
    for kw in ({"request_rate": 0.0}, {"request_rate": -1.0}, {"request_rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError):
            arrival_times(3, **kw)  # type: ignore[arg-type]


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_load_jsonl_happy_path(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jpg").write_bytes(b"y")
    path = _write(tmp_path, [json.dumps({"prompt": "what is this?", "images": ["a.png", "sub/b.jpg"], "max_tokens": 7}),
                             "", json.dumps({"prompt": "text only"})])
    reqs = load_jsonl(path, default_max_tokens=33)
    assert [r.request_id for r in reqs] == ["jsonl-1", "jsonl-3"]
    assert reqs[0].images == [str((tmp_path / "a.png").resolve()), str((tmp_path / "sub" / "b.jpg").resolve())]
    assert reqs[0].image_keys == reqs[0].images and reqs[0].max_tokens == 7 and reqs[0].prompt == "what is this?"
    assert reqs[1].images == [] and reqs[1].max_tokens == 33
    with_ph = load_jsonl(path, placeholder=PH)
    assert with_ph[0].prompt == PH * 2 + "what is this?" and with_ph[1].prompt == "text only"


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"images": []}', "'prompt' must be a string"),
    ('{"prompt": "x", "images": "a.png"}', "'images' must be a list"),
    ('{"prompt": "x", "images": ["missing.png"]}', "not found"),
    ('{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be a positive int"),
    ('{"prompt": "x", "image": ["a.png"]}', "unknown field"),
])
def test_load_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "fine"}), line])
    with pytest.raises(ValueError, match=message) as info:
        load_jsonl(path)
    assert f"{path}:2" in str(info.value)


def test_load_jsonl_empty(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests"):
        load_jsonl(_write(tmp_path, [""]))
