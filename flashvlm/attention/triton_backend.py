"""Triton attention over the paged KV cache: kv_write, split-K paged decode, varlen paged prefill.

forward() reads only device tensors from the metadata plus host ints fixed when the batch was built
(max_query_len, max_seq_len, tensor shapes), so a decode step can be captured in a CUDA graph. Pure-decode
batches go to the split-K decode kernel; anything with a chunk longer than one token goes to the prefill kernel,
which also serves the decode tokens of a mixed batch.
"""

from __future__ import annotations

import torch

from flashvlm.attention.base import AttentionBackend, AttentionMetadata, AttentionStep
from flashvlm.attention.kv_quant import is_fp8, require_scales
from flashvlm.kernels.dispatch import interpreter_active

try:
    from flashvlm.kernels.kv_write import kv_write
    from flashvlm.kernels.paged_decode import choose_num_splits, paged_decode
    from flashvlm.kernels.paged_prefill import paged_prefill

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # triton missing or broken: fail when the backend is built, not at package import
    _IMPORT_ERROR = exc


class TritonBackend(AttentionBackend):
    name = "triton"
    graph_capturable = True

    def __init__(self, max_seq_len_bound: int | None = None, max_splits: int = 64) -> None:
        """max_seq_len_bound: when set (e.g. max_model_len for CUDA-graph capture), the decode split count
        depends only on the batch shape, so graphs captured at one length stay well split at any other.
        Correctness never depends on the split count; only speed does."""
        if _IMPORT_ERROR is not None:
            raise ImportError(f"the 'triton' attention backend needs Triton ({_IMPORT_ERROR}); "
                              "install flashvlm[gpu] or use the 'reference' backend") from _IMPORT_ERROR
        self.max_seq_len_bound = max_seq_len_bound
        self.max_splits = max_splits
        self._num_sms: dict[torch.device, int] = {}

    def build_metadata(self, step: AttentionStep) -> AttentionMetadata:
        """The shared metadata without host copies: forward reads device tensors and the two host bounds only."""
        return AttentionMetadata.of(step, query_start_loc_host=None, seq_lens_host=None)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
        kv_write(k, v, kv_cache, meta.slot_mapping, *self._scales(kv_cache, k_scale, v_scale))

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        if not q.is_cuda and not interpreter_active():
            raise RuntimeError("the triton backend runs on CPU tensors only under TRITON_INTERPRET=1")
        k_scale, v_scale = self._scales(kv_cache, k_scale, v_scale)
        if meta.is_pure_decode:
            num_splits = self.num_decode_splits(q.device, meta.seq_lens.shape[0], kv_cache.shape[3], meta.max_seq_len)
            return paged_decode(q, kv_cache, meta.block_tables, meta.seq_lens, scale, num_splits=num_splits,
                                k_scale=k_scale, v_scale=v_scale, key_bias=meta.slot_bias)
        return paged_prefill(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                             max_query_len=meta.max_query_len, k_scale=k_scale, v_scale=v_scale,
                             key_bias=meta.slot_bias)

    @staticmethod
    def _scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The scales the kernels take: the layer's for an FP8 cache, none for a cache in the model's dtype (whose
        kernels are compiled without them)."""
        return require_scales(k_scale, v_scale) if is_fp8(kv_cache) else (None, None)

    def num_decode_splits(self, device: torch.device, num_seqs: int, kv_heads: int, max_seq_len: int) -> int:
        bound = self.max_seq_len_bound if self.max_seq_len_bound is not None else max_seq_len
        return choose_num_splits(num_seqs, kv_heads, bound, num_sms=self._sm_count(device), max_splits=self.max_splits)

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            on_gpu = device.type == "cuda" and torch.cuda.is_available()
            # 132 = H100/H200 SXM; only the CPU interpreter path uses it, where it merely picks a split count.
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 132
        return self._num_sms[device]
