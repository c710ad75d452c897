"""Flat per-step input tensors built from a SchedulerOutput, on the host with numpy, then moved at once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashvlm.attention.base import AttentionBackend, AttentionStep
from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.layers.attention import ForwardContext
from flashvlm.models.interfaces import KVCacheSpec


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    """(N,) int64"""
    positions: torch.Tensor
    """(N,) or (3, N) int64"""
    attn_step: AttentionStep
    """The step's attention layout; the backend builds its metadata from it."""
    sample_rows: torch.Tensor
    """(S,) indices into the flat batch of the last token of each request that samples this step."""
    sample_request_ids: list[str]


class PositionStore:
    """Per-request prompt positions (computed once per request by the model) and the rope delta."""

    def __init__(self) -> None:
        self._prompt: dict[str, np.ndarray] = {}
        self._delta: dict[str, int] = {}

    def has(self, request_id: str) -> bool:
        return request_id in self._prompt

    def put(self, request_id: str, prompt_positions: torch.Tensor, delta: int) -> None:
        self._prompt[request_id] = np.asarray(prompt_positions.cpu().numpy(), dtype=np.int64)  # no copy if int64
        self._delta[request_id] = int(delta)

    def drop(self, request_id: str) -> None:
        self._prompt.pop(request_id, None)
        self._delta.pop(request_id, None)

    def decode_position(self, request_id: str, index: int) -> int | None:
        """Position of generated token `index` (the same on every M-RoPE axis), or None inside the prompt."""
        prompt_len = self._prompt[request_id].shape[-1]
        return index + self._delta[request_id] if index >= prompt_len else None

    def is_mrope(self, request_id: str) -> bool:
        return self._prompt[request_id].ndim == 2

    def slice(self, request_id: str, start: int, end: int) -> np.ndarray:
        """Positions of tokens [start, end): prompt positions, then index + delta for generated tokens."""
        prompt = self._prompt[request_id]
        prompt_len = prompt.shape[-1]
        parts = []
        if start < prompt_len:
            parts.append(prompt[..., start:min(end, prompt_len)])
        if end > prompt_len:
            generated = np.arange(max(start, prompt_len), end, dtype=np.int64) + self._delta[request_id]
            parts.append(np.broadcast_to(generated, (*prompt.shape[:-1], generated.shape[0])))
        return np.concatenate(parts, axis=-1)


def general_step_inputs(out: SchedulerOutput, positions: PositionStore, block_size: int,
                        device: torch.device) -> StepInputs:
    """Any step: prefill chunks, decode tokens, or both (numpy per request)."""
    scheduled = out.scheduled
    counts = [s.num_new_tokens for s in scheduled]
    query_start = np.zeros(len(scheduled) + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    total = int(query_start[-1])
    ids = np.empty(total, dtype=np.int64)
    slots = np.empty(total, dtype=np.int64)
    pos_parts = []
    max_blocks = max(len(s.block_ids) for s in scheduled)
    block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
    seq_lens, sample_rows, sample_ids = [], [], []
    for i, s in enumerate(scheduled):
        req, a, b = s.request, s.start, s.end
        lo, hi = int(query_start[i]), int(query_start[i + 1])
        ids[lo:hi] = _token_slice(req.prompt_token_ids, req.output_token_ids, a, b)
        table = np.asarray(s.block_ids, dtype=np.int64)
        token_index = np.arange(a, b)
        slots[lo:hi] = table[token_index // block_size] * block_size + token_index % block_size
        block_tables[i, : len(table)] = table
        pos_parts.append(positions.slice(req.request_id, a, b))
        seq_lens.append(b)
        if s.samples:
            sample_rows.append(hi - 1)
            sample_ids.append(req.request_id)
    pos = np.concatenate(pos_parts, axis=-1)

    def dev(x: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype, non_blocking=True)

    step = AttentionStep(
        query_start_loc=dev(query_start, torch.int32), seq_lens=dev(np.asarray(seq_lens), torch.int32),
        block_tables=dev(block_tables, torch.int32),
        slot_mapping=dev(slots, torch.int64), block_size=block_size,
        query_start_loc_host=query_start.tolist(), seq_lens_host=seq_lens, max_query_len=max(counts),
        max_seq_len=max(seq_lens))
    return StepInputs(input_ids=dev(ids, torch.int64), positions=dev(pos, torch.int64), attn_step=step,
                      sample_rows=dev(np.asarray(sample_rows, dtype=np.int64), torch.int64),
                      sample_request_ids=sample_ids)


@dataclass
class DecodeBatch:
    """A step of one generated token per request, on the host: what both the eager path (as device tensors)
    and the decode graphs (through their pinned staging buffers) are built from."""

    token_ids: list[int]
    positions: list[int]
    """Position of each token; the same on every M-RoPE axis for generated tokens."""
    mrope: bool
    slots: list[int]
    seq_lens: list[int]
    block_ids: list[list[int]]
    sample_rows: list[int]
    sample_request_ids: list[str]

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)


def decode_batch(out: SchedulerOutput, positions: PositionStore, block_size: int) -> DecodeBatch | None:
    """The step as a DecodeBatch when every request computes one generated token, else None (a prefill chunk,
    or a resumed prefill's last prompt token, which the general path handles). Plain lists: numpy's per-call
    cost, paid several times per request, dominated a large decode batch's host time."""
    scheduled = out.scheduled
    if not scheduled or any(s.num_new_tokens != 1 for s in scheduled):
        return None
    ids, slots, seq_lens, pos, sample_rows, sample_ids = [], [], [], [], [], []
    for i, s in enumerate(scheduled):
        req, index = s.request, s.start
        p = positions.decode_position(req.request_id, index)
        if p is None:
            return None
        ids.append(req.output_token_ids[index - len(req.prompt_token_ids)])
        slots.append(s.block_ids[index // block_size] * block_size + index % block_size)
        seq_lens.append(index + 1)
        pos.append(p)
        if s.samples:
            sample_rows.append(i)
            sample_ids.append(req.request_id)
    return DecodeBatch(ids, pos, positions.is_mrope(scheduled[0].request.request_id), slots, seq_lens,
                       [s.block_ids for s in scheduled], sample_rows, sample_ids)


def decode_step_inputs(batch: DecodeBatch, block_size: int, device: torch.device) -> StepInputs:
    num = batch.num_seqs
    block_tables = np.zeros((num, max(len(b) for b in batch.block_ids)), dtype=np.int32)
    for i, blocks in enumerate(batch.block_ids):
        block_tables[i, : len(blocks)] = blocks

    def dev(values: list[int] | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(values, dtype=dtype).to(device=device, non_blocking=True)

    positions = dev(batch.positions, torch.int64)
    if batch.mrope:
        positions = positions.expand(3, num).contiguous()
    qsl = list(range(num + 1))
    step = AttentionStep(
        query_start_loc=dev(qsl, torch.int32), seq_lens=dev(batch.seq_lens, torch.int32),
        block_tables=dev(block_tables, torch.int32), slot_mapping=dev(batch.slots, torch.int64),
        block_size=block_size, query_start_loc_host=qsl, seq_lens_host=batch.seq_lens, max_query_len=1,
        max_seq_len=max(batch.seq_lens))
    return StepInputs(input_ids=dev(batch.token_ids, torch.int64), positions=positions, attn_step=step,
                      sample_rows=dev(batch.sample_rows, torch.int64), sample_request_ids=batch.sample_request_ids)


def _token_slice(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output without concatenating the two lists every step."""
    n = len(prompt)
    if end <= n:
        return prompt[start:end]
    if start >= n:
        return output[start - n:end - n]
    return prompt[start:] + output[:end - n]


def single_sequence_context(num_tokens: int, spec: KVCacheSpec, dtype: torch.dtype, device: str | torch.device,
                            block_size: int, backend: AttentionBackend) -> ForwardContext:
    """A fresh KV cache holding exactly one sequence, and metadata to prefill all its tokens at once: for
    memory profiling and for running a model without the engine in tests."""
    num_blocks = (num_tokens + block_size - 1) // block_size + 1  # block 0 is the null block
    kv = [torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype, device=device)
          for _ in range(spec.num_layers)]
    blocks = torch.arange(1, num_blocks, dtype=torch.int32, device=device)
    step = AttentionStep(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=blocks[None, :],
        slot_mapping=torch.arange(block_size, block_size + num_tokens, dtype=torch.int64, device=device),
        block_size=block_size, query_start_loc_host=[0, num_tokens], seq_lens_host=[num_tokens],
        max_query_len=num_tokens, max_seq_len=num_tokens)
    return ForwardContext(attn_meta=backend.build_metadata(step), kv_caches=kv, backend=backend)
