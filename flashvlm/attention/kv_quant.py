"""The KV cache's storage dtype and the FP8 (e4m3) arithmetic every backend shares, in plain torch.

An FP8 cache stores k / k_scale and v / v_scale, saturated to e4m3's finite range (+-448) and rounded to nearest
even; a read multiplies the stored value by the scale again. The scales are per layer (one float32 for K, one for
V), owned by the layer's `PagedAttention` (its `k_scale` / `v_scale` buffers) and passed to the backends with
every call. The Triton kernels do the same arithmetic; the functions here are their reference and the
ReferenceBackend's implementation (docs/quantization.md, "KV cache").
"""

from __future__ import annotations

import torch

from flashvlm.config import E5M2_REFUSAL, KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(FP8_KV_DTYPE).max)
"""448: the largest finite e4m3 value; writes saturate here (e4m3fn has no infinity)."""

def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for the option's value."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return FP8_KV_DTYPE
    if kv_cache_dtype == "fp8_e5m2":
        raise ValueError(E5M2_REFUSAL)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r} (one of {', '.join(KV_CACHE_DTYPES)})")


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16', 'float8_e4m3fn', ...: how results and logs name a cache dtype."""
    return str(dtype).removeprefix("torch.")


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in float32, saturated to +-448, rounded to e4m3 (x any float dtype; scale a 1-element tensor)."""
    return (x.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stored e4m3 values times the scale, in float32, then cast to `dtype`."""
    return (x.float() * scale.float()).to(dtype)


def require_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two scales an FP8 cache needs; a call without them is a bug, never a silent 1.0."""
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 KV cache needs the layer's k_scale and v_scale")
    return k_scale, v_scale


def scatter_into(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """cache (slots, ...) [slots] = values, for any cache dtype (torch has no index_copy_ for float8: the bytes
    are copied through a uint8 view)."""
    if cache.dtype == FP8_KV_DTYPE:
        cache.view(torch.uint8).index_copy_(0, slots, values.view(torch.uint8))
    else:
        cache.index_copy_(0, slots, values)


def fp8_kv_unavailable_reason(device: str | torch.device) -> str | None:
    """Why our Triton kernels cannot read or write an e4m3 cache on `device`, or None when they can. Triton converts
    to and from e4m3 on sm_89 and later (Ada, Hopper); CPU tensors run it under the interpreter."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
    except Exception as exc:  # e.g. cuda:N past the last GPU: the engine reports the device itself later
        return f"cannot read the capability of {device}: {exc}"
    if (major, minor) < (8, 9):
        return f"Triton's e4m3 conversions need an sm_89 or newer GPU, not sm_{major}{minor}"
    return None
