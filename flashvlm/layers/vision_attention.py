"""The vision tower's attention op: bidirectional attention inside each segment (an image, or a window of one)
of a packed token batch, through the vision backend the engine chose by name (`attention/vision.py`)."""

from __future__ import annotations

import torch

from flashvlm.attention.vision import vision_backend


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int],
                     scale: float | None = None, impl: str = "sdpa") -> torch.Tensor:
    """q, k, v: (tokens, heads, dim); cu_seqlens: host list of segment boundaries -> (tokens, heads, dim).
    impl: a registered vision backend's name ("sdpa", "fa4"); each falls back to torch's kernels for inputs its
    own kernel does not take."""
    return vision_backend(impl).forward(q, k, v, tuple(int(c) for c in cu_seqlens), scale)
