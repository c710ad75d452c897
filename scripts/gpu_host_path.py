"""The host's share of a 1008x756 request's time to first token, piece by piece, on the machine that runs the
benchmarks: tokenizing, hashing and copying the picture (InputProcessor.process), and its upload from
pageable memory against a copy into pinned memory plus an asynchronous upload.

    PYTHONPATH=. python scripts/gpu_host_path.py      # medians in ms on stdout
"""

from __future__ import annotations

import itertools
import tempfile
import time

import numpy as np
import torch
import xxhash

from flashvlm.bench.model_configs import write_benchmark_model
from flashvlm.config import ModelConfig
from flashvlm.models.loader import read_checkpoint
from flashvlm.processing.input_processor import InputProcessor

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def main() -> None:
    path = write_benchmark_model("qwen2-vl-7b", tempfile.mkdtemp())
    ckpt = read_checkpoint(ModelConfig(model=str(path)))
    proc = InputProcessor(ckpt, 152064, ckpt.hf_config.image_token_id, pixel_cache_bytes=0)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (756, 1008, 3), dtype=np.uint8) for _ in range(40)]
    words = " ".join(f"w{i}" for i in rng.integers(1000, 9000, 64))
    it = itertools.cycle(images)
    keep: list = []

    def process() -> None:  # the previous request's pixels are freed as the next one's are made, as in a run
        keep[:] = [proc.process({"prompt": PLACEHOLDER + words, "images": [next(it)]})]

    rows = {"process (tokenize + hash + copy)": median_ms(process)}
    rows["tokenize 64 words"] = median_ms(lambda: proc.tokenizer.encode(PLACEHOLDER + words))
    rows["xxh3-128 of the picture"] = median_ms(lambda: xxhash.xxh3_128(next(it)).digest())
    rows["bytearray copy, freed each time"] = median_ms(lambda: bytearray(next(it)))
    dev = torch.device("cuda")
    pinned = torch.empty((756, 1008, 3), dtype=torch.uint8, pin_memory=True)

    def pageable() -> None:
        torch.from_numpy(next(it)).to(dev, non_blocking=True)

    def staged() -> None:
        pinned.copy_(torch.from_numpy(next(it)))
        pinned.to(dev, non_blocking=True)

    for name, fn in (("upload from pageable memory (host time)", pageable), ("copy to pinned + async upload", staged)):
        fn()
        torch.cuda.synchronize()
        rows[name] = median_ms(lambda fn=fn: (fn(), torch.cuda.synchronize()))
    for name, ms in rows.items():
        print(f"  {ms:7.3f} ms  {name}")


if __name__ == "__main__":
    main()
