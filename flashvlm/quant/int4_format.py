"""compressed-tensors' `pack-quantized` format for 4-bit integer weights (what llm-compressor's W4A16 and
W4A16_ASYM presets write), and its conversion to the kernels' run-time layout (kernels/int4_layout.py).

Per quantized linear layer of weight (N, K), groups of g inputs (G = ceil(K / g)):
- `weight_packed` int32 (N, ceil(K / 8)): signed codes q in -8..7 stored as q + 8; word j holds input 8j + i in
  bits 4i..4i+3.
- `weight_scale` (N, G) in the model's float dtype.
- `weight_zero_point` int32 (ceil(N / 8), G), asymmetric schemes only: zero points z in -8..7 stored as z + 8 and
  packed the same way but along the output dimension (word r of column g holds output row 8r + i in nibble i).
- `weight_shape` int64 (2,): [N, K].
W[n, k] = (q - z) * scale (z = 0 when symmetric). Rounding (the library's min-max observer and quantize):
symmetric scale = max|w| / 7.5, asymmetric scale = (max(w, 0) - min(w, 0)) / 15 and z = round(-8 - min / scale)
clamped to -8..7; q = clamp(round(w / scale + z), -8, 7), rounding half to even.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashvlm.kernels.int4_layout import pack_planes

CODE_OFFSET = 8
"""Signed 4-bit values are stored as unsigned codes value + 8."""


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """codes (R, C) integers in 0..15 -> (R, ceil(C / 8)) int32, 8 consecutive codes of a row per word."""
    r, c = codes.shape
    padded = F.pad(codes.to(torch.int64), (0, -c % 8)).view(r, -1, 8)
    shifts = 4 * torch.arange(8, device=codes.device, dtype=torch.int64)
    words = (padded << shifts).sum(dim=-1)  # disjoint bits: the sum is an OR
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The inverse of pack_rows: (R, W) int32 -> (R, cols) uint8 codes."""
    shifts = 4 * torch.arange(8, device=packed.device, dtype=torch.int32)
    codes = (packed.unsqueeze(-1) >> shifts) & 15
    return codes.flatten(1)[:, :cols].to(torch.uint8)


def _grouped(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) -> (N, G, g), the last group padded with zeros (which change neither min nor max)."""
    n, k = weight.shape
    return F.pad(weight, (0, -k % group_size)).view(n, -1, group_size)


def rtn_codes(weight: torch.Tensor, group_size: int, symmetric: bool, scale_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round to nearest: (codes (N, K) uint8 in 0..15, scale (N, G) in scale_dtype, zero codes (N, G) uint8 or
    None when symmetric). The arithmetic runs in the weight's dtype, step by step as the library's observer and
    quantizer do it, so a bf16 weight gets the library's codes; the codes use the scale as stored."""
    n, k = weight.shape
    w = _grouped(weight, group_size)
    lo = w.amin(dim=-1).clamp(max=0)
    hi = w.amax(dim=-1).clamp(min=0)
    scale = torch.maximum(hi, -lo) / 7.5 if symmetric else (hi - lo) / 15
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale).to(scale_dtype)  # an all-zero group
    s = scale.to(w.dtype)
    zero = None if symmetric else torch.round(-8 - lo / s).clamp(-8, 7)
    scaled = w / s[..., None]
    q = torch.round(scaled if zero is None else scaled + zero[..., None]).clamp(-8, 7)
    codes = (q + CODE_OFFSET).to(torch.uint8).flatten(1)[:, :k]
    zero_codes = None if zero is None else (zero + CODE_OFFSET).to(torch.uint8)
    return codes, scale, zero_codes


def compress(weight: torch.Tensor, group_size: int, symmetric: bool,
             scale_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A float weight (N, K) as the pack-quantized tensors of its layer (names without the module prefix)."""
    codes, scale, zero = rtn_codes(weight, group_size, symmetric, scale_dtype or weight.dtype)
    out = {"weight_packed": pack_rows(codes), "weight_scale": scale,
           "weight_shape": torch.tensor(list(weight.shape), dtype=torch.int64)}
    if zero is not None:
        out["weight_zero_point"] = pack_rows(zero.t().contiguous()).t().contiguous()
    return out


def decompress(tensors: dict[str, torch.Tensor], group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The float weight a layer's pack-quantized tensors stand for, each element rounded once to `dtype`."""
    n, k = (int(v) for v in tensors["weight_shape"])
    codes = unpack_rows(tensors["weight_packed"], k).to(torch.float32)
    group = torch.arange(k, device=codes.device) // group_size
    scale = tensors["weight_scale"].to(torch.float32)[:, group]
    zero = float(CODE_OFFSET)
    if "weight_zero_point" in tensors:
        zero = unpack_rows(tensors["weight_zero_point"].t().contiguous(), n).t().to(torch.float32)[:, group]
    return ((codes - zero) * scale).to(dtype)


def to_runtime(weight_packed: torch.Tensor, weight_scale: torch.Tensor, zero_point: torch.Tensor | None,
               k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Checkpoint tensors -> the kernels' (qweight, scales (G, N) in dtype, zeros (G, N) uint8 or None)."""
    n = weight_packed.shape[0]
    qweight = pack_planes(unpack_rows(weight_packed, k))
    scales = weight_scale.to(dtype).t().contiguous()
    zeros = None
    if zero_point is not None:
        zeros = unpack_rows(zero_point.t().contiguous(), n).contiguous()  # (G, N): already transposed
    return qweight, scales, zeros
