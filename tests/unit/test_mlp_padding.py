"""GatedMLP.pad_intermediate: an intermediate width that is no multiple of 8 (Qwen2.5-VL's vision MLP: 3,420) is
widened to a multiple of 64 with zero channels once the weights are in, with the same output; aligned widths,
MLPs that did not ask, and quantized layers are left alone. Parity of a padded tower against transformers is in
the Qwen2.5-VL end-to-end tests (the tiny checkpoint's vision width is unaligned on purpose)."""

from __future__ import annotations

import pytest
import torch

from flashvlm.layers.mlp import GatedMLP, pad_unaligned_mlps


def _mlp(width: int, act: str = "silu", pad: bool = True) -> GatedMLP:
    torch.manual_seed(width)
    mlp = GatedMLP(24, width, act, bias=True, pad_unaligned=pad)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    return mlp


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_padding_keeps_the_output(act: str) -> None:
    mlp = _mlp(70, act)
    x = torch.randn(5, 24)
    before = mlp(x)
    assert mlp.pad_intermediate()
    assert mlp.gate_up_proj.weight.shape == (256, 24) and mlp.gate_up_proj.bias.shape == (256,)
    assert mlp.down_proj.weight.shape == (24, 128) and mlp.gate_up_proj.out_sizes == [128, 128]
    assert mlp.gate_up_proj.weight[70:128].abs().sum() == 0 and mlp.down_proj.weight[:, 70:].abs().sum() == 0
    torch.testing.assert_close(mlp(x), before, rtol=1e-5, atol=1e-4)  # the summation order may change
    assert not mlp.pad_intermediate()  # now aligned: a second call does nothing


def test_aligned_unasked_and_quantized_mlps_stay() -> None:
    aligned, unasked, quantized = _mlp(64), _mlp(70, pad=False), _mlp(70)
    quantized.down_proj = torch.nn.Identity()  # a layer of another type, as a quantization pass installs
    model = torch.nn.ModuleList([aligned, unasked, quantized, _mlp(70)])
    assert pad_unaligned_mlps(model) == 1
    assert aligned.down_proj.in_features == 64 and unasked.down_proj.in_features == 70
    assert quantized.gate_up_proj.out_sizes == [70, 70]
