"""Log-probabilities of the sampled tokens, for the rows whose request asks (SamplingParams.logprobs).

They come from the model's raw logits (before repetition penalty, min_tokens bans, temperature and the top-k/p
filters), as vLLM's default: one float32 log_softmax over the asking rows, then the sampled token's entry and
the top-k. The device results join the step's sampled tokens in one read-back, so a step with logprobs rows
still waits on the device once; a step without any runs exactly as before. The temporaries (two float32 copies
of the asking rows' logits) live after the sampler's have been freed, well under the sampler's profiled peak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flashvlm.request import SamplingParams, TokenLogprobs
from flashvlm.runner.sampler import host_to_device


@dataclass
class PendingLogprobs:
    """The asking rows' log-probabilities, still on the device."""

    rows: list[int]
    """The asking rows' indices among the step's sampled rows."""
    request_ids: list[str]
    num_top: list[int]
    """Each row's SamplingParams.logprobs."""
    sampled: torch.Tensor
    """(rows,) float32: the sampled token's log-probability."""
    top_values: torch.Tensor
    """(rows, k) float32, most likely first; k is the largest num_top of the step (may be 0)."""
    top_ids: torch.Tensor
    """(rows, k) int64."""


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, request_ids: Sequence[str],
                    params: Sequence[SamplingParams]) -> PendingLogprobs | None:
    """Log-probabilities of the rows of `logits` (the raw model logits, one row per request) whose params ask,
    for the tokens sampled from them; None when no row asks."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    num_top = [params[i].logprobs for i in rows]
    if len(rows) == logits.shape[0]:
        asking, asked_tokens = logits, tokens
    else:
        index = host_to_device(rows, torch.int64, logits.device)
        asking, asked_tokens = logits.index_select(0, index), tokens.index_select(0, index)
    logprobs = asking.float().log_softmax(dim=-1)
    sampled = logprobs.gather(1, asked_tokens.view(-1, 1)).view(-1)
    top_values, top_ids = logprobs.topk(max(num_top), dim=-1)
    return PendingLogprobs(rows, [request_ids[i] for i in rows], num_top, sampled, top_values, top_ids)


def read_back(tokens: torch.Tensor, pending: PendingLogprobs | None) -> tuple[list[int], dict[str, TokenLogprobs]]:
    """The step's sampled tokens and the asking rows' TokenLogprobs by request id, read from the device with one
    wait (the one `tokens.tolist()` alone would take)."""
    if pending is None:
        return tokens.tolist(), {}
    on_device = (tokens, pending.sampled, pending.top_values, pending.top_ids)
    if tokens.is_cuda:
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in on_device]
        for dst, src in zip(host, on_device):
            dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
    else:
        host = list(on_device)
    token_list, sampled, top_values, top_ids = (t.tolist() for t in host)
    entries = {}
    for j, (row, rid, k) in enumerate(zip(pending.rows, pending.request_ids, pending.num_top)):
        entries[rid] = TokenLogprobs(token_id=token_list[row], logprob=sampled[j],
                                     top=tuple(zip(top_ids[j][:k], top_values[j][:k])))
    return token_list, entries
