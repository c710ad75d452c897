"""Token sampling for one engine step: penalties, eos masking, greedy and filtered random sampling.

Semantics follow transformers' logits processors (repetition penalty, then temperature, top-k,
top-p, min-p) so that greedy decoding is token-identical to ``generate`` and sampling has the
same distribution. Per-row work is vectorised over the batch; the only Python loop is over rows
that carry their own ``torch.Generator``, because a generator cannot be shared across a batched
random call without making a seeded row's draws depend on its neighbours.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashvlm.request import Request, SamplingParams
from flashvlm.runner.token_mask import TokenMask, apply_token_mask

# Exponential(1) draws can underflow to 0 in float32; dividing by it would turn a zero
# probability into NaN and a tiny one into inf, so clamp the noise away from zero.
_MIN_NOISE = 1e-20
# Largest top_k for which a partial sort (torch.topk) beats sorting the whole vocabulary.
_PARTIAL_SORT_MAX_K = 1024


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A generator for a request's ``SamplingParams.seed``; ``None`` (use the shared RNG) without one.

    The runner should create it once per request and keep it for the request's lifetime (also
    across preemption), passing it to the sampler only on steps that actually sample a token for
    that request, so that the sequence of draws is the same in every run and every batch.
    """
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def host_to_device(values: list | np.ndarray | torch.Tensor, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """Host list, array or tensor -> device tensor without blocking the host on the device stream."""
    if isinstance(values, torch.Tensor):
        cpu = values.to(dtype)
    elif isinstance(values, np.ndarray):
        cpu = torch.from_numpy(values).to(dtype)
    else:
        cpu = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return cpu
    # A pageable-memory copy waits for the stream; a pinned one is queued behind the model.
    return cpu.pin_memory().to(device, non_blocking=True)


def banned_stop_tokens(params: Sequence[SamplingParams], num_output_tokens: Sequence[int],
                       eos_token_ids: Sequence[tuple[int, ...]], vocab: int) -> list[list[int]]:
    """Each row's tokens that min_tokens bans now (its stop tokens, and EOS unless ignore_eos), within the vocab."""
    out: list[list[int]] = []
    for p, n, eos in zip(params, num_output_tokens, eos_token_ids):
        banned = set() if n >= p.min_tokens else set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
        out.append(sorted(t for t in banned if 0 <= t < vocab))
    return out


@dataclass
class SamplerInputs:
    """What the sampler needs of each row besides its logits, one entry per row (all the same length)."""

    params: Sequence[SamplingParams]
    prev_token_ids: Sequence[Sequence[int]]
    """Prompt + output ids of each row, for the repetition penalty (may be empty for rows without one)."""
    num_output_tokens: Sequence[int]
    """Tokens each row has produced so far, for ``min_tokens``."""
    eos_token_ids: Sequence[tuple[int, ...]]
    generators: Sequence[torch.Generator | None]
    """Each row's own generator (a seeded request), or None for the sampler's default one."""
    token_mask: TokenMask | None = None
    """Structured outputs: the allowed tokens of the constrained rows (None: no row is constrained)."""

    @classmethod
    def for_requests(cls, requests: Sequence[Request], generators: dict[str, torch.Generator | None],
                     token_mask: TokenMask | None = None) -> SamplerInputs:
        """The rows of `requests`, in order; token history only for rows with a repetition penalty."""
        return cls(params=[r.sampling_params for r in requests],
                   prev_token_ids=[r.all_token_ids if r.sampling_params.repetition_penalty != 1.0 else ()
                                   for r in requests],
                   num_output_tokens=[len(r.output_token_ids) for r in requests],
                   eos_token_ids=[r.eos_token_ids for r in requests],
                   generators=[generators.get(r.request_id) for r in requests], token_mask=token_mask)

    def __len__(self) -> int:
        return len(self.params)

    def check(self, num_rows: int) -> None:
        if not (len(self.params) == len(self.prev_token_ids) == len(self.num_output_tokens)
                == len(self.eos_token_ids) == len(self.generators) == num_rows):
            raise ValueError(f"sampler inputs disagree on the batch size ({num_rows} logits rows)")
        mask = self.token_mask
        if mask is not None and (len(mask.rows) != mask.bitmask.shape[0]
                                 or any(not 0 <= r < num_rows for r in mask.rows)):
            raise ValueError(f"token mask rows {mask.rows} do not fit the batch ({num_rows} rows)")


class Sampler:
    """Turns the last-position logits of a batch into one token id per row.

    ``default_generator`` is used for rows without a per-request generator; ``None`` means the
    global torch RNG of the logits' device.
    """

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, rows: SamplerInputs) -> torch.Tensor:
        """Sample one token per row of ``logits`` (B, V); returns int64 (B,) on the logits' device."""
        num_rows = logits.shape[0]
        rows.check(num_rows)
        if num_rows == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)

        logits = self.apply_penalties(logits, rows)
        params, generators = rows.params, rows.generators

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return logits.argmax(dim=-1)
        if len(random_rows) == num_rows:
            return self._sample(logits, [params[i] for i in random_rows], list(generators))

        # Mixed batch: sample only the random rows, then merge with the argmax of the rest.
        greedy = logits.argmax(dim=-1)
        index = host_to_device(random_rows, torch.int64, logits.device)
        sampled = self._sample(logits.index_select(0, index), [params[i] for i in random_rows],
                               [generators[i] for i in random_rows])
        return greedy.index_copy(0, index, sampled)

    def apply_penalties(self, logits: torch.Tensor, rows: SamplerInputs) -> torch.Tensor:
        """The float32 logits that greedy decoding takes the argmax of: repetition penalty applied, a constrained
        row's disallowed tokens at -inf, and stop tokens banned below ``min_tokens`` (unless they are all its
        constraint allows). Never writes into ``logits`` (may return it as is)."""
        logits = logits.float()
        logits = self._apply_repetition_penalty(logits, rows.params, rows.prev_token_ids)
        if rows.token_mask is None:
            return self._mask_stop_tokens(logits, rows.params, rows.num_output_tokens, rows.eos_token_ids)
        logits = apply_token_mask(logits, rows.token_mask)
        banned = self._mask_stop_tokens(logits, rows.params, rows.num_output_tokens, rows.eos_token_ids)
        if banned is logits:
            return logits
        # A complete constraint allows only its stop tokens: min_tokens then yields to it rather than leave the
        # row no token at all (decided on the device, without a sync).
        return torch.where(torch.isfinite(banned).any(dim=-1, keepdim=True), banned, logits)

    def greedy(self, logits: torch.Tensor, rows: SamplerInputs, use_kernel: bool) -> torch.Tensor:
        """Tokens of rows that are all greedy: the argmax of `apply_penalties`. With `use_kernel` and no repetition
        penalty, one fused pass over the logits (kernels/masked_greedy.py) instead of a dozen torch kernels."""
        if not use_kernel or any(p.repetition_penalty != 1.0 for p in rows.params):
            return self.apply_penalties(logits, rows).argmax(dim=-1)
        from flashvlm.kernels.masked_greedy import masked_greedy_triton

        device = logits.device
        mask_rows = [-1] * len(rows)
        bitmask = None
        if rows.token_mask is not None:
            for j, i in enumerate(rows.token_mask.rows):
                mask_rows[i] = j
            bitmask = host_to_device(rows.token_mask.bitmask, torch.int32, device)
        banned = banned_stop_tokens(rows.params, rows.num_output_tokens, rows.eos_token_ids, logits.shape[1])
        width = max(map(len, banned), default=0)
        table = [b + [-1] * (width - len(b)) for b in banned]
        return masked_greedy_triton(logits, bitmask, host_to_device(mask_rows, torch.int32, device),
                                    host_to_device(table, torch.int64, device).view(len(rows), width))

    # --- logits processors --------------------------------------------------------------------
    # A processor added here must also be ruled out by `is_plain_argmax`.

    @staticmethod
    def is_plain_argmax(params: SamplingParams, num_output_tokens: int) -> bool:
        """Whether a row's token is simply the argmax of its raw logits: greedy, and no logits processor changes
        anything (no repetition penalty, min_tokens reached, no structured-output constraint). The decode
        lookahead relies on it."""
        return (params.greedy and params.repetition_penalty == 1.0 and num_output_tokens >= params.min_tokens
                and params.structured_outputs is None)

    @staticmethod
    def _apply_repetition_penalty(
        logits: torch.Tensor, params: Sequence[SamplingParams], prev_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        if not rows:
            return logits
        num_rows, vocab = logits.shape
        # Ragged id lists go over as one flat tensor plus lengths; np.fromiter over a chain is
        # several times faster than torch.tensor(list) for the ~1e5 ids of a long-prompt batch.
        # Out-of-vocab ids land in an extra column that is dropped.
        row_lengths = [len(prev_token_ids[i]) for i in rows]
        total = sum(row_lengths)
        flat = np.fromiter(itertools.chain.from_iterable(prev_token_ids[i] for i in rows),
                           dtype=np.int64, count=total)
        lengths = host_to_device(row_lengths, torch.int64, logits.device)
        ids = host_to_device(flat, torch.int64, logits.device)
        ids = torch.where((ids >= 0) & (ids < vocab), ids, vocab)
        # output_size keeps repeat_interleave from reading the lengths back to the host.
        row_index = torch.repeat_interleave(host_to_device(rows, torch.int64, logits.device), lengths,
                                            output_size=total)
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        # A device-side True: `seen[...] = True` copies the Python scalar over and syncs.
        seen.index_put_((row_index, ids), seen.new_ones(()))
        seen = seen[:, :vocab]
        penalty = [float(p.repetition_penalty) for p in params]
        pen = host_to_device(penalty, torch.float32, logits.device).unsqueeze(1)
        penalized = torch.where(logits < 0, logits * pen, logits / pen)
        return torch.where(seen, penalized, logits)

    @staticmethod
    def _mask_stop_tokens(
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        eos_token_ids: Sequence[tuple[int, ...]],
    ) -> torch.Tensor:
        """While a row is below ``min_tokens``, forbid everything that would end it."""
        rows: list[int] = []
        cols: list[int] = []
        for i, banned in enumerate(banned_stop_tokens(params, num_output_tokens, eos_token_ids, logits.shape[1])):
            rows += [i] * len(banned)
            cols += banned
        if not rows:
            return logits
        index = host_to_device([rows, cols], torch.int64, logits.device)
        # new_full fills on the device; torch.tensor(..., device=cuda) would copy from the host.
        return logits.index_put((index[0], index[1]), logits.new_full((), float("-inf")))

    def _sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row; every row here is non-greedy."""
        device = logits.device
        # Finite: temperatures too small to divide by (below GREEDY_TEMPERATURE) count as greedy and never get here.
        temperature = host_to_device([float(p.temperature) for p in params], torch.float32, device)
        logits = logits / temperature.unsqueeze(1)

        use_top_k = any(0 < p.top_k < logits.shape[1] for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            logits = self._filter_top_k_top_p(logits, params, use_top_k, use_top_p)

        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = host_to_device([float(p.min_p) for p in params], torch.float32, device)
            threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
            # The top token always survives (its prob equals the max), so no row goes empty.
            probs = probs.masked_fill(probs < threshold, 0.0)

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i
        # (normalisation is irrelevant) and needs no host sync, unlike torch.multinomial.
        noise = torch.empty_like(probs)
        shared = [i for i, g in enumerate(generators) if g is None]
        if len(shared) == len(generators):
            noise.exponential_(generator=self.default_generator)
        else:
            if shared:
                noise.exponential_(generator=self.default_generator)
            for i, gen in enumerate(generators):
                if gen is not None:
                    noise[i].exponential_(generator=gen)
        noise.clamp_min_(_MIN_NOISE)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _filter_top_k_top_p(
        logits: torch.Tensor, params: Sequence[SamplingParams], use_top_k: bool, use_top_p: bool,
    ) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[1]
        k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        k_max = max(k)
        if k_max <= _PARTIAL_SORT_MAX_K:
            # Every row keeps at most k_max tokens, so only those need ordering: topk is far
            # cheaper than sorting a 150k vocabulary. Rows with a smaller k mask the rest below.
            # (A logit exactly tied with the k_max-th one but left out of the window escapes
            # top-p; transformers splits such ties by sort order, so neither is canonical.)
            sorted_logits, sorted_idx = logits.topk(k_max, dim=-1)
        else:
            sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        if use_top_k:
            k_index = host_to_device(k, torch.int64, device).unsqueeze(1) - 1
            # Threshold on the k-th largest value (ties at the boundary survive), as transformers does.
            kth = sorted_logits.gather(1, k_index)
            logits = logits.masked_fill(logits < kth, float("-inf"))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if use_top_p:
            # inf disables the filter exactly; 1.0 could drop tail tokens through cumsum rounding.
            top_p = host_to_device([p.top_p if p.top_p < 1.0 else float("inf") for p in params],
                               torch.float32, device)
            sorted_probs = sorted_logits.softmax(dim=-1)
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
            drop_sorted = mass_before >= top_p.unsqueeze(1)
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, sorted_idx, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return logits
