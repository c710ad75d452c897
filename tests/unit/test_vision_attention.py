"""Varlen vision attention equals per-segment SDPA for any segment layout (windows, several images, empties)."""

import pytest
import torch
import torch.nn.functional as F

from flashvlm.layers.vision_attention import varlen_attention


@pytest.mark.parametrize("cu", [[0, 10], [0, 4, 10, 14, 20, 21], [0, 5, 5, 12], [0, 3, 6, 9, 12], [0, 4, 4, 8, 12]])
def test_matches_per_segment_attention(cu: list[int]) -> None:
    g = torch.Generator().manual_seed(len(cu))
    q, k, v = (torch.randn(cu[-1], 2, 8, generator=g) for _ in range(3))
    out = varlen_attention(q, k, v, cu, scale=0.3)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            ref = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                 v[a:b].transpose(0, 1), scale=0.3).transpose(0, 1)
            torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cu,gathers", [([0, 3, 6, 9, 12], 0), ([0, 4, 4, 8, 12], 0), ([0, 4, 10, 14, 20, 21], 9)])
def test_equal_segments_take_no_gather(cu: list[int], gathers: int, monkeypatch) -> None:
    """Same-size images (or windows) that tile the tokens in order are a view, not a gather and a scatter; the
    strided q/k/v views of a packed QKV projection work too."""
    calls = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: calls.append(1) or real(self, *a))
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(cu[-1], 3, 2, 8, generator=g)
    q, k, v = qkv.unbind(1)
    out = varlen_attention(q, k, v, cu, scale=0.3)
    assert len(calls) == gathers and out.shape == q.shape
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            ref = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                 v[a:b].transpose(0, 1), scale=0.3).transpose(0, 1)
            torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-5)


def test_boundaries_not_from_zero_are_not_taken_as_a_view() -> None:
    """Equal segments that do not start at token 0 are not a tiling of the tokens: no silent view."""
    q = torch.randn(8, 2, 8)
    with pytest.raises(IndexError):
        varlen_attention(q, q, q, [2, 6, 10])
