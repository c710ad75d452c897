"""Structured outputs' token masks on the logits: one bitmask for the step's constrained rows, applied on the
device with torch ops, after the repetition penalty and before the min_tokens ban, temperature and sampling.

The bitmask crosses to the device once per step (ceil(vocab / 32) int32 words per constrained row: 19 KB for a
150k vocabulary), is unpacked there to booleans and sets every disallowed logit of those rows to -inf; the other
rows are not touched. Log-probabilities are read from the raw logits (runner/logprobs.py), never from these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def words_per_row(vocab_size: int) -> int:
    """int32 words of one bitmask row."""
    return (vocab_size + 31) // 32


@dataclass
class TokenMask:
    """The step's allowed tokens for its constrained rows, one bitmask row each."""

    rows: list[int]
    """Indices of the constrained rows among the step's sampled rows (ascending)."""
    bitmask: torch.Tensor
    """(len(rows), ceil(vocab / 32)) int32 on the host: bit t % 32 of word t // 32 set = token t allowed."""


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 words -> (R, vocab_size) bool; tokens past the words' 32 * W bits are disallowed.

    Unpacked byte by byte (token t is bit t % 8 of byte t // 8 of the little-endian words), so the temporaries are
    one byte per token, not an int32 per token."""
    data = bitmask.contiguous().view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = ((data.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """`logits` (B, V) with the masked rows' disallowed tokens at -inf; never writes into `logits`."""
    device = logits.device
    words = mask.bitmask.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else mask.bitmask
    allowed = unpack_bitmask(words.to(device), logits.shape[1])
    if mask.rows == list(range(logits.shape[0])):
        return logits.masked_fill(~allowed, float("-inf"))
    rows = torch.tensor(mask.rows, dtype=torch.int64)
    rows = rows.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else rows
    masked = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, masked)
