"""When a layer runs a Triton kernel instead of its torch reference.

Policy: Triton kernels run on CUDA tensors when Triton imports, unless the layer was built with its kernels off
(`set_kernel_backend(model, "torch")`, applied once by the engine from its config) or a caller passes
`enabled=False`. The setting lives on each layer, so two engines in one process never affect each other.
CPU tensors always take the torch path, so CPU parity tests never depend on Triton. Tests reach the kernels
on CPU tensors with `force=True`, which needs Triton's interpreter (`TRITON_INTERPRET=1`, set before the
kernel modules are imported).

Nothing here imports Triton at module load: CPU-only processes never pay for it, and a test can still set
`TRITON_INTERPRET` after `flashvlm.layers` was imported (the `@triton.jit` decorator reads it when the kernel
module is first imported, which only happens on the first kernel call).
"""

from __future__ import annotations

import functools
import os

import torch


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


def use_triton(x: torch.Tensor, enabled: bool | None = None, force: bool = False) -> bool:
    """Whether to run the Triton kernel for an op whose main input is `x`.

    `enabled` is the calling layer's own setting (engines set it per model, see `set_kernel_backend`). `force`
    demands the kernel (tests) and raises rather than silently comparing the torch path against itself.
    """
    if force:
        if not triton_available():
            raise RuntimeError("force=True needs Triton installed")
        if not x.is_cuda and not interpreter_active():
            raise RuntimeError("Triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
        return True
    if not x.is_cuda:
        return False
    if enabled is False:
        return False
    return triton_available()


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def set_kernel_backend(model: torch.nn.Module, backend: str) -> None:
    """Set every fused-kernel layer of `model` to Triton ("triton", CUDA tensors only) or torch ("torch")."""
    for module in model.modules():
        if hasattr(module, "use_triton_kernels"):
            module.use_triton_kernels = backend == "triton"
