"""Plain-torch attention over the paged KV cache: gathers each sequence's blocks and runs SDPA.

Correct on any device and the yardstick for the fast backends; it loops over sequences on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashvlm.attention.base import AttentionBackend, AttentionMetadata
from flashvlm.attention.kv_quant import dequantize_kv, is_fp8, require_scales
from flashvlm.kernels.paged_args import context_slots


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if is_fp8(kv_cache):
            k_scale, v_scale = require_scales(k_scale, v_scale)
        out = torch.empty_like(q)
        num_heads, bs = q.shape[1], meta.block_size
        for i in range(meta.num_seqs):
            start, end = meta.query_start_loc_host[i], meta.query_start_loc_host[i + 1]
            seq_len = meta.seq_lens_host[i]
            num_new = end - start
            blocks = meta.block_tables[i, : (seq_len + bs - 1) // bs].long()
            k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
            v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
            if is_fp8(kv_cache):
                k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
            groups = num_heads // k.shape[1]
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            # 4-D (1, heads, len, dim) so SDPA can pick a fused kernel instead of its math fallback.
            qi = q[start:end].transpose(0, 1)[None]
            k, v = k.transpose(0, 1)[None].to(q.dtype), v.transpose(0, 1)[None].to(q.dtype)
            ctx = seq_len - num_new
            bias = self._key_bias(meta, blocks, seq_len)
            if bias is not None:
                key_pos = torch.arange(seq_len, device=q.device)
                query_pos = torch.arange(ctx, seq_len, device=q.device)
                allowed = key_pos[None, :] <= query_pos[:, None]
                mask = torch.where(allowed, bias[None, :], float("-inf")).to(q.dtype)
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
            elif num_new == 1:
                o = F.scaled_dot_product_attention(qi, k, v, scale=scale)
            elif ctx == 0:
                o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale)
            else:
                key_pos = torch.arange(seq_len, device=q.device)
                query_pos = torch.arange(ctx, seq_len, device=q.device)
                mask = key_pos[None, :] <= query_pos[:, None]
                o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale)
            o = o[0]
            out[start:end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _key_bias(meta: AttentionMetadata, blocks: torch.Tensor, seq_len: int) -> torch.Tensor | None:
        """The logit bias of a sequence's keys (seq_len,) from meta.slot_bias, or None where it has none or it is
        zero on every key (the unbiased kernels then run, and outputs stay what they were without the store)."""
        if meta.slot_bias is None:
            return None
        bias = meta.slot_bias.index_select(0, context_slots(blocks, meta.block_size, seq_len))
        return bias if bool(bias.any()) else None
