"""How long a step's device work took, without adding a host sync."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flashvlm.request import MMItem


@dataclass
class StepTimings:
    """Where the last step's time went. Device work is timed with CUDA events on GPU (read after the
    step's one host sync, so timing adds no sync), with host clocks on CPU."""

    vision_s: float = 0.0
    forward_s: float = 0.0
    """Embedding, language-model forward, logits and sampling."""
    num_images: int = 0
    prepare_s: float = 0.0
    """Host time choosing the execution path and building its inputs."""
    encoded_items: tuple[MMItem, ...] = ()
    """The images the vision tower encoded (as the request holds them: host pixels, not the device copies)."""


class StepTimer:
    """A start/stop pair of CUDA events, or host clock readings on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.end_event = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.cuda:
            self.start_event.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.end_event.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        """Call only after the device work has finished (after the step's host sync)."""
        if self.cuda:
            return self.start_event.elapsed_time(self.end_event) / 1e3
        return self.t1 - self.t0

    def finished(self) -> bool:
        """Whether the device has passed the stop reading (the start is before it on the same stream)."""
        return not self.cuda or self.end_event.query()
