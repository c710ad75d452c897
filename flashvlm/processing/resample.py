"""Pillow resizes of several pictures at once (a video's frames, LLaVA-NeXT's fitted and base images), spread over
the threads torch may use (`torch.get_num_threads()`, the caller's CPU budget).

Each picture still goes through Pillow's own resampler whole, so results are bit for bit those of one
`Image.resize` call (what the HF PIL-backend processors do); Pillow releases the GIL while it resamples, so the
pictures resize in parallel. With one thread everything runs inline, in order."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import torch
from PIL import Image

T = TypeVar("T")

_POOL: ThreadPoolExecutor | None = None
"""Made on first use; a forked child has none of the parent's worker threads, so it forgets the pool."""
_POOL_SIZE = min(8, os.cpu_count() or 1)
"""Workers of the shared pool; a call uses at most torch.get_num_threads() of them (the caller's CPU budget, the
calling thread included). 8 already split a 16-frame video into two frames a worker."""


_POOL_LOCK = threading.Lock()
"""The server's image threads may ask for the pool at once: one of them makes it."""


def _after_fork_in_child() -> None:
    global _POOL, _POOL_LOCK
    # A fork while another thread held the lock must not leave the child's copy locked.
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_POOL_SIZE, thread_name_prefix="flashvlm-resize")
        return _POOL


def run_parallel(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """The jobs' results in order, run on up to torch.get_num_threads() threads (the calling one included)."""
    workers = min(len(jobs), torch.get_num_threads(), _POOL_SIZE)
    if workers <= 1:
        return [job() for job in jobs]
    # Contiguous chunks, one per worker: fewer hand-offs than a task per job. The caller runs the first one.
    bounds = np.linspace(0, len(jobs), workers + 1).round().astype(int)
    chunks = [jobs[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    futures = [_pool().submit(lambda c=c: [job() for job in c]) for c in chunks[1:]]
    out = [job() for job in chunks[0]]
    for f in futures:
        out += f.result()
    return out


def resize_images(images: Sequence[Image.Image], sizes: Sequence[tuple[int, int]], resample: int) -> list[Image.Image]:
    """Each image resized to its (height, width), itself where it already has that size."""
    def job(img: Image.Image, hw: tuple[int, int]) -> Callable[[], Image.Image]:
        return lambda: img if (img.height, img.width) == hw else img.resize(hw[::-1], resample=resample)

    return run_parallel([job(img, hw) for img, hw in zip(images, sizes)])


def resize_frames(frames: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """(N, H, W, 3) uint8 frames -> (N, height, width, 3) uint8, each frame as `Image.resize` gives it."""
    out = np.empty((frames.shape[0], height, width, frames.shape[3]), dtype=np.uint8)

    def job(i: int) -> Callable[[], None]:
        def run() -> None:
            out[i] = np.asarray(Image.fromarray(frames[i]).resize((width, height), resample=resample))
        return run

    run_parallel([job(i) for i in range(frames.shape[0])])
    return out
