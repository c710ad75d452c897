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
import importlib.util
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


FA4_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes FlashAttention-4's kernels take."""
_FA4_MAJORS = (9,)
"""Compute capabilities we run FlashAttention-4 on: Hopper (sm_90), where it was measured and tested. Its
Blackwell kernels take other head dims and have not run here."""


@functools.cache
def _fa4_import_error() -> str | None:
    """None when FA4's interface imports (its CuTe DSL compiler, cutlass-dsl for this CUDA, included); else why
    not. Tried once per process: a package that finds its module but fails to import reads as missing."""
    try:
        import flash_attn.cute.interface  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def device_unavailable_reason(device: str) -> str | None:
    """Why `device` (already checked to be cpu, cuda or cuda:N) cannot be used on this machine, or None."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        built = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU found"
        return f"CUDA is not available on this machine (torch {torch.__version__}: {built}); use 'cpu' or 'auto'"
    index = device.partition(":")[2]
    count = torch.cuda.device_count()
    if index and (not index.isdigit() or int(index) >= count):
        return f"no such GPU: this machine has {count} (cuda:0 to cuda:{count - 1})"
    return None


def fa4_unavailable_reason(device: str | torch.device) -> str | None:
    """Why the optional FlashAttention-4 package cannot run on `device`, or None when it can."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "FlashAttention-4 needs a CUDA device"
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except Exception as exc:  # e.g. cuda:N past the last GPU: the engine reports the device itself later
        return f"cannot read the capability of {device}: {exc}"
    if major not in _FA4_MAJORS:
        return f"FlashAttention-4 runs here on Hopper GPUs (sm_90) only, not sm_{major}{minor}"
    try:  # imports the parent package `flash_attn`, which may be another release's, broken or missing
        found = importlib.util.find_spec("flash_attn.cute") is not None
    except Exception:
        found = False
    if not found:
        return "FlashAttention-4 is not installed (pip install 'flashvlm[fa4]')"
    error = _fa4_import_error()
    return None if error is None else f"FlashAttention-4 is installed but does not import ({error})"


def fa4_takes(q: torch.Tensor) -> bool:
    """Whether FlashAttention-4's Hopper kernels take queries like `q` (tokens, heads, head_dim): CUDA, bf16 or
    fp16, a head dim that is a multiple of 8 up to 256. Callers fall back to their other kernel otherwise, so a
    float32 model on an engine that chose FA4 still runs."""
    dim = q.shape[-1]
    return q.is_cuda and q.dtype in FA4_DTYPES and dim % 8 == 0 and 8 <= dim <= 256


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
