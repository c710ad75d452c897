"""When a layer runs a Triton kernel instead of its torch reference.

Policy: Triton kernels run on CUDA tensors when Triton imports, unless the engine switched them off through
`set_triton_enabled` (from its config) or a caller passes `enabled=False`. CPU tensors always take the torch
path, so CPU parity tests never depend on Triton. Tests reach the kernels on CPU tensors with `force=True`,
which needs Triton's interpreter (`TRITON_INTERPRET=1`, set before the kernel modules are imported).

Nothing here imports Triton at module load: CPU-only processes never pay for it, and a test can still set
`TRITON_INTERPRET` after `flashvlm.layers` was imported (the `@triton.jit` decorator reads it when the kernel
module is first imported, which only happens on the first kernel call).
"""

from __future__ import annotations

import functools
import os

import torch

_enabled = True


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works; tried once, on the first CUDA tensor or forced call."""
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install (missing driver libraries) must degrade to torch, not crash
        return False
    return True


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def set_triton_enabled(enabled: bool) -> None:
    """Process-wide switch, set once by the engine from its config (e.g. to bisect a numerical issue)."""
    global _enabled
    _enabled = bool(enabled)


def triton_enabled() -> bool:
    return _enabled


def use_triton(x: torch.Tensor, enabled: bool | None = None, force: bool = False) -> bool:
    """Whether to run the Triton kernel for an op whose main input is `x`.

    `enabled` overrides the process-wide switch for one call. `force` demands the kernel (tests) and raises
    rather than silently comparing the torch path against itself.
    """
    if force:
        if not triton_available():
            raise RuntimeError("force=True needs Triton installed")
        if not x.is_cuda and not interpreter_active():
            raise RuntimeError("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
        return True
    if not x.is_cuda:
        return False
    if not (_enabled if enabled is None else enabled):
        return False
    return triton_available()


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
