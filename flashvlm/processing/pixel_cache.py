"""Preprocessed pixels that took work (a resize, GPU preprocessing, CLIP's crop) are kept in a small LRU keyed by
the content hash (which is computed before the resize, from the decoded image and the processor parameters), so
a picture sent again (a follow-up turn, a retry) costs a decode and a hash, not another resize. Pixels that are
one copy of the decoded image are not kept: the copy is cheaper than holding fresh memory.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class PixelCache:
    """Thread-safe LRU of preprocessed images by mm_hash, bounded in bytes (images are processed on the image
    pool's workers and the offline feeder's threads). Cached tensors are shared: nothing may modify them in place."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_hits = 0
        self._entries: OrderedDict[str, tuple[Any, Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, mm_hash: str) -> tuple[Any, Any] | None:
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None:
                return None
            self._entries.move_to_end(mm_hash)
            self.num_hits += 1
            return entry[0], entry[1]

    def put(self, mm_hash: str, pixels: Any, layout: Any) -> None:
        size = pixels.numel() * pixels.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            if mm_hash in self._entries:
                return
            self._entries[mm_hash] = (pixels, layout, size)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)
