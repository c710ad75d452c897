"""The run-time layout of 4-bit weights for the W4A16 kernels (kernels/int4_matmul.py), and its plain-torch
reference product.

A weight W (N, K) is stored as unsigned 4-bit codes u in 0..15, a scale per (group of `group_size` inputs,
output column) and an unsigned zero code per group and column (8 for symmetric schemes):
W[n, k] = (u[n, k] - zero[k // g, n]) * scale[k // g, n].

`qweight` (N, K_pad / 8) int32, K_pad = K rounded up to BLOCK_K (256). Within each block of 256 inputs, word j
(0..31) holds in its nibble i (bits 4i..4i+3) the code of input 32 * i + j. So nibble i of a block's 32 words is
one plane of 32 consecutive inputs: a kernel unpacks a plane with one shift and one mask and multiplies it
with 32 consecutive columns of x, without reordering either operand. A plane lies inside one group whenever
the group size is a multiple of 32. Padded inputs hold code 0; the kernels never read their x (masked to 0).

`scales` (G, N) in the activation dtype and `zeros` (G, N) uint8, G = ceil(K / g): transposed, so a kernel's
column block reads one contiguous run per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK_K = 256
"""Inputs per packed block (the kernels' K step)."""
PLANE = 32
"""Inputs per nibble plane: BLOCK_K / 8."""
SYMMETRIC_ZERO = 8
"""The unsigned zero code of a symmetric scheme (signed codes -8..7 stored as 0..15)."""


def padded_k(k: int) -> int:
    return -(-k // BLOCK_K) * BLOCK_K


def pack_planes(codes: torch.Tensor) -> torch.Tensor:
    """codes (N, K) integers in 0..15 -> qweight (N, padded_k(K) / 8) int32 in the plane layout."""
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D, got {tuple(codes.shape)}")
    n, k = codes.shape
    c = F.pad(codes.to(torch.int64), (0, padded_k(k) - k))
    c = c.view(n, -1, 8, PLANE)  # (N, blocks, nibble i, word j)
    shifts = (4 * torch.arange(8, device=codes.device, dtype=torch.int64)).view(1, 1, 8, 1)
    words = (c << shifts).sum(dim=2)  # disjoint bits: the sum is an OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's-complement int32
    return words.view(n, -1).to(torch.int32)


def unpack_planes(qweight: torch.Tensor, k: int) -> torch.Tensor:
    """qweight (N, K_pad / 8) int32 -> codes (N, k) uint8; the inverse of pack_planes."""
    n = qweight.shape[0]
    words = qweight.view(n, -1, 1, PLANE)
    shifts = (4 * torch.arange(8, device=qweight.device, dtype=torch.int32)).view(1, 1, 8, 1)
    codes = (words >> shifts) & 15  # arithmetic shift, then the mask drops the sign bits
    return codes.view(n, -1)[:, :k].to(torch.uint8)


def w4a16_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                     k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The float weight (N, k) the kernels multiply with: each element rounded once to `dtype` (default the
    scales' dtype) from the exact product (u - zero) * scale, as the kernels round their tiles."""
    n, groups = qweight.shape[0], scales.shape[0]
    codes = F.pad(unpack_planes(qweight, k), (0, groups * group_size - k)).view(n, groups, group_size)
    scale = scales.to(torch.float32).t().unsqueeze(-1)  # (N, G, 1): broadcast over each group
    zero = SYMMETRIC_ZERO if zeros is None else zeros.to(torch.float32).t().unsqueeze(-1)
    return ((codes.to(torch.float32) - zero) * scale).to(dtype or scales.dtype).view(n, -1)[:, :k]


def w4a16_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ dequantized W^T (+ bias) with torch's linear in x's dtype."""
    weight = w4a16_dequantize(qweight, scales, zeros, group_size, x.shape[-1], x.dtype)
    return F.linear(x, weight, bias)
