"""The numbers of an FP8 linear layer, in plain torch: rounding to e4m3 with float32 scales, and the product the
layer computes. `fp8_linear_reference` is both the CPU path and what every faster path (torch._scaled_mm, the
Triton FP8 GEMV) is tested against.

Conventions every path shares: a scale is amax / 448 (e4m3's largest finite value) in float32, floored at
`MIN_SCALE` so an all-zero row or token divides by something; a value rounds as `(x / scale)` clamped to
[-448, 448] and cast to float8_e4m3fn (round to nearest even); it dequantizes as `q.float() * scale`.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
MIN_SCALE = 1e-12
"""Floor of every computed scale (an all-zero row: its values round to 0 whatever the scale)."""


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    # Divided by a tensor: CUDA torch turns division by a Python number into a multiply by its reciprocal, which
    # can round differently in the last bit; IEEE division gives the same scales on every device.
    amax = amax.float()
    return (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=MIN_SCALE)


def round_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale rounded to e4m3 (scale broadcasts against x)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_groups(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the rows of a 2-D tensor, one scale per row (group None) or per row and `group` columns (the last
    group may be short). Returns (e4m3 values like x, float32 scales (rows, 1) or (rows, ceil(cols / group)))."""
    if group is None:
        scale = scale_of(x.abs().amax(dim=-1, keepdim=True))
        return round_e4m3(x, scale), scale
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    scale = scale_of(padded.abs().amax(dim=-1))
    return round_e4m3(x, expand_columns(scale, group, cols)), scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Round a 2-D weight with a scale per (rows, cols) tile (partial tiles at the edges): (e4m3 like w, float32
    scales (ceil(N / rows), ceil(K / cols)))."""
    (n, k), (bn, bk) = w.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    tiles = torch.nn.functional.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n)).view(nb, bn, kb, bk)
    scale = scale_of(tiles.abs().amax(dim=(1, 3)))
    full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return round_e4m3(w, full), scale


def expand_columns(scale: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    """(rows, groups) scales repeated over each group's columns: (rows, cols)."""
    return scale.repeat_interleave(group, dim=1)[:, :cols]


def dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor, block_cols: int | None = None,
                      dtype: torch.dtype = torch.float32,
                      compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight (N, K) e4m3 times its scales: (N,) per row, or (N, ceil(K / block_cols)) per row and column block;
    multiplied in compute_dtype, returned in dtype."""
    w, scale = weight.to(compute_dtype), weight_scale.to(compute_dtype)
    if scale.dim() == 1:
        return (w * scale[:, None]).to(dtype)
    n, k = weight.shape
    if k % int(block_cols) == 0:  # each scale over its block of columns, without an (N, K) copy of the scales
        return (w.view(n, -1, int(block_cols)) * scale[:, :, None]).view(n, k).to(dtype)
    return (w * expand_columns(scale, int(block_cols), k)).to(dtype)


def quantize_activation(x: torch.Tensor, activation: str | None, input_scale: torch.Tensor | None = None,
                        group: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The e4m3 activations and their scales as the scheme says; None for weight-only (x stays as it is)."""
    if activation is None:
        return None
    if activation == "static":
        if input_scale is None:
            raise ValueError("static fp8 activations need an input scale")
        scale = input_scale.float().reshape(1, 1)
        return round_e4m3(x, scale), scale.expand(x.shape[0], 1)
    return quantize_groups(x, group)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, *, activation: str | None = "dynamic",
                         input_scale: torch.Tensor | None = None, block_cols: int | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x.dtype: activations rounded as `activation` says and dequantized, times the
    dequantized weight, accumulated in float32, plus bias. `block_cols`: the columns of a block weight's scale
    (and, dynamic, of each activation scale)."""
    w = dequantize_weight(weight, weight_scale, block_cols)
    group = block_cols if weight_scale.dim() == 2 else None
    quantized = quantize_activation(x, activation, input_scale, group)
    if quantized is None:
        xf = x.float()
    else:
        q, scale = quantized
        xf = q.float() * (scale if group is None or activation == "static" else
                          expand_columns(scale, group, x.shape[1]))
    out = xf @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
