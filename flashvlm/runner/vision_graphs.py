"""CUDA graphs of the vision tower, one per batch shape (the images' patch grids), for shapes that recur.

Why: the tower runs eagerly, and on the H200 its launches cost more host time than its arithmetic costs GPU time
(measured eagerly on the H200, a 1008x756 image took 28-35 ms against a ~10 ms compute floor). Screenshots and product
photos come in a few sizes, so a shape seen before is worth a graph: the second time a shape arrives it is
captured, and from then on replayed. Shapes seen once stay eager, so a stream of one-off sizes never pays for
captures. At most `max_graphs` graphs are kept (least recently used goes first); they share one memory pool,
and their replays never overlap (one engine thread).

Replay copies the new pixels into the captured input buffers and returns copies of the outputs (the encoder
cache keeps them, and the next replay overwrites the graph's own).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from flashvlm.attention.vision import keep_index_tensors
from flashvlm.request import MMItem
from flashvlm.runner.cuda_graph import capture_graph

logger = logging.getLogger(__name__)

Encoder = Callable[[list[MMItem]], list[torch.Tensor]]


@dataclasses.dataclass
class _Entry:
    graph: Any
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    keepalive: list
    """Device tensors the graph reads by address that nobody else is sure to keep (attention index tensors)."""


class VisionGraphs:
    def __init__(self, encode: Encoder, device: torch.device, dtype: torch.dtype, max_graphs: int = 4,
                 max_patches: int = 16384, graph_factory: Callable[[], Any] | None = None) -> None:
        """encode: the model's `encode_images`. graph_factory: makes a graph object with `capture(fn, pool)`
        -> outputs and `replay()`; the default wraps torch.cuda.CUDAGraph (tests pass an eager stand-in)."""
        self.encode, self.device, self.dtype = encode, device, dtype
        self.max_graphs, self.max_patches = max_graphs, max_patches
        self.graph_factory = graph_factory or _CudaGraph
        self._graphs: OrderedDict[tuple, _Entry] = OrderedDict()
        self._seen: dict[tuple, int] = {}
        self._failed: set[tuple] = set()
        self.pool = None
        self.num_captures = 0
        self.num_replays = 0

    @staticmethod
    def key(items: list[MMItem]) -> tuple:
        return tuple((tuple(torch.as_tensor(it.pixel_values).shape), it.layout, it.encoder_tokens) for it in items)

    def __call__(self, items: list[MMItem]) -> list[torch.Tensor]:
        # A graph replays its tower on the pixels copied into its input buffers as they are, so compact items
        # (uint8 pixels that `model_pixels` finishes) are finished first, as the eager tower would.
        items = [it.finished(self.device) for it in items]
        key = self.key(items)
        entry = self._graphs.get(key)
        if entry is None:
            patches = sum(torch.as_tensor(it.pixel_values).shape[0] for it in items)
            self._seen[key] = self._seen.get(key, 0) + 1
            if self.max_graphs < 1 or self._seen[key] < 2 or patches > self.max_patches or key in self._failed:
                return self.encode(items)
            try:
                entry = self._capture(key, items)
            except Exception:  # a capture can fail (another thread's CUDA call); this shape then stays eager
                logger.warning("vision graph capture failed for grids %s; running it eagerly",
                               [it.layout for it in items], exc_info=True)
                self._failed.add(key)
                return self.encode(items)
        else:
            self._graphs.move_to_end(key)
        for buf, it in zip(entry.inputs, items):
            buf.copy_(torch.as_tensor(it.pixel_values), non_blocking=True)
        entry.graph.replay()
        self.num_replays += 1
        return [out.clone() for out in entry.outputs]

    def _capture(self, key: tuple, items: list[MMItem]) -> _Entry:
        if len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)  # its graph's memory returns to the shared pool
            if not self._graphs:
                self.pool = None  # no graph holds the pool any more: the next capture starts a new one
        inputs = [torch.empty(torch.as_tensor(it.pixel_values).shape, dtype=self.dtype, device=self.device)
                  for it in items]
        for buf, it in zip(inputs, items):
            buf.copy_(torch.as_tensor(it.pixel_values))
        static = [dataclasses.replace(it, pixel_values=buf) for it, buf in zip(items, inputs)]
        graph = self.graph_factory()
        with keep_index_tensors() as keepalive:
            outputs = graph.capture(lambda: self.encode(static), self.pool)
        self.pool = getattr(graph, "pool", None) or self.pool
        entry = _Entry(graph, inputs, outputs, keepalive)
        self._graphs[key] = entry
        self.num_captures += 1
        logger.info("captured a vision graph for grids %s", [it.layout for it in items])
        return entry


class _CudaGraph:
    def __init__(self) -> None:
        self.graph = None
        self.pool = None

    def capture(self, fn: Callable[[], list[torch.Tensor]], pool: Any) -> list[torch.Tensor]:
        # thread_local: image preprocessing threads (--preprocess-on-gpu) may issue CUDA calls meanwhile.
        # No warm-up runs: a shape is captured the second time it comes, so its kernels compiled and its
        # allocations happened at the first; each eager run would add ~30 ms and its thousand launches to the
        # request that pays for the capture.
        self.graph, self.pool, outputs = capture_graph(fn, pool, error_mode="thread_local", warmups=0)
        return outputs

    def replay(self) -> None:
        self.graph.replay()
