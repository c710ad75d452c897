"""FlashAttention-4 (the optional `flash-attn-4` package, CuTe DSL kernels) where it beats our own kernels.

On the H200 (docs/BENCHMARKS.md) it runs the ViT's attention at head dim 80 as it is, where cuDNN pads
to 128 (774-795 against 1,058-1,069 us for one 1344x1344 image's 9,216 patches), and the LM's causal GQA prefill
over our paged cache in 88 us where our Triton kernel takes 161 (one prompt of 2,370 tokens). Decode keeps our
split-K kernel: its graphs and split counts are tuned for one token per sequence.

Optional: only on a Hopper GPU does anything import the package, once, when the engine's config asks
`kernels.dispatch.fa4_unavailable_reason` whether it runs (not installed or not importable, no CUDA device, a
GPU other than Hopper: the reason says which).
"""

from __future__ import annotations

import functools

import torch

from flashvlm.attention.base import AttentionMetadata
from flashvlm.attention.triton_backend import TritonBackend
from flashvlm.kernels.dispatch import fa4_takes


@functools.cache
def _varlen_func():
    from flash_attn.cute.interface import flash_attn_varlen_func

    return flash_attn_varlen_func


def _output(result: torch.Tensor | tuple) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


def check_inputs(q: torch.Tensor) -> None:
    if not fa4_takes(q):
        raise ValueError(f"FlashAttention-4 takes CUDA bf16/fp16 tensors with a head dim that is a multiple of 8 up "
                         f"to 256, got {q.dtype} on {q.device}, head dim {q.shape[-1]}")


def varlen_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          max_len: int, scale: float | None = None) -> torch.Tensor:
    """Bidirectional attention inside each segment. q, k, v: (tokens, heads, dim); cu_seqlens: (segments + 1,)
    int32 on the device; max_len: the longest segment (a host int, so no sync) -> (tokens, heads, dim)."""
    check_inputs(q)
    return _output(_varlen_func()(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_len,
                                  max_seqlen_k=max_len, softmax_scale=scale))


class FlashAttn4Backend(TritonBackend):
    """Prefill, cached-prefix and mixed steps through FA4 over the paged cache; pure decode through our kernel.

    FA4's causal mask is aligned to the end of each sequence's context, which is exactly a chunk whose earlier
    tokens are cached. It reads device tensors only and takes host bounds from the metadata (the bucket's sizes
    under CUDA graphs), so prefill steps stay capturable. Padding sequences of a graph bucket have no queries
    and length 0 and get no work."""

    name = "fa4"

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        # A float32 model or an FP8 cache (the engine already moves both off this backend at start-up), or a key
        # bias (proportional attention; FA4 takes none): our kernel.
        if meta.is_pure_decode or not fa4_takes(q) or kv_cache.dtype != q.dtype or meta.slot_bias is not None:
            return super().forward(q, kv_cache, meta, scale, k_scale, v_scale)
        result = _varlen_func()(q, kv_cache[0], kv_cache[1], cu_seqlens_q=meta.query_start_loc,
                                seqused_k=meta.seq_lens, page_table=meta.block_tables,
                                max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
                                softmax_scale=scale, causal=True)
        return _output(result)
