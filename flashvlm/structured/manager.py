"""Every constrained request's matcher, in step with the request's output tokens.

One owner of the grammar state: the engine adds a request's matcher when it accepts the request (`add`: the
compile error, if any, is that request's 400), advances it after each step's update (`advance`) and drops it when
the request finishes (`drop`); the runner asks for the step's bitmask (`bitmask`). A matcher has accepted exactly
the request's output tokens: `advance` accepts `output_token_ids[num_accepted:]`, so a token is accepted once
whatever path produced it, and a preempted request (recomputed, its output tokens kept) needs no replay. Should a
matcher ever be ahead of its request's tokens, it is reset and replayed from them.

Filling a step's masks is the grammar's largest host cost (about 60 us a row on a 150k vocabulary). Right after
`advance`, the engine has the next masks filled on a thread of their own (`prepare`; xgrammar releases the GIL)
while it detokenizes and schedules, and the step that samples those requests takes them ready. A matcher is
never advanced while a fill that reads it runs: `advance` first waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from flashvlm.request import Request
from flashvlm.runner.token_mask import TokenMask, words_per_row
from flashvlm.structured.grammar import GrammarEngine, Matcher
from flashvlm.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

REJECTED_STOP_REASON = "structured_output_rejected"
"""stop_reason of a constrained request whose sampled token its grammar refused (only possible when another
rule bans every token the grammar allows, e.g. min_tokens banning the end of a finished JSON value)."""


@dataclass
class _FilledMasks:
    """Masks filled ahead of the step that samples them: row `rows[id][0]` of `bitmask` is for request `id`, after
    `rows[id][1]` of its output tokens."""

    rows: dict[str, tuple[int, int]]
    bitmask: torch.Tensor

    def row_of(self, request_id: str, num_accepted: int) -> int | None:
        row, accepted = self.rows.get(request_id, (None, -1))
        return row if accepted == num_accepted else None


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.grammar = GrammarEngine(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._matchers: dict[str, Matcher] = {}
        self._fill_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashvlm-masks")
        self._filling: Future[_FilledMasks] | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def check(self, spec: StructuredOutputsParams | None) -> None:
        """Compile `spec` (cached): raises InvalidRequestError for a bad constraint or a missing engine."""
        if spec is not None:
            self.grammar.compile(spec)

    def add(self, req: Request) -> None:
        spec = req.sampling_params.structured_outputs
        if spec is not None:
            self._matchers[req.request_id] = self.grammar.matcher(spec)

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def advance(self, requests: Sequence[Request]) -> tuple[list[str], list[str]]:
        """Accept each constrained request's output tokens its matcher has not seen. Returns the ids of those whose
        grammar refused a token, and of those whose grammar has ended (its stop token accepted); the caller ends
        both. Unconstrained requests are skipped."""
        self._take_filled()  # its matchers are about to move on
        refused: list[str] = []
        one: list[tuple[Request, Matcher]] = []  # the usual case: one new token, accepted in one batch call
        for req in requests:
            m = self._matchers.get(req.request_id)
            if m is None:
                continue
            tokens = req.output_token_ids
            if m.num_accepted > len(tokens):
                m.reset()
            pending = tokens[m.num_accepted:]
            if len(pending) == 1 and not m.is_terminated():
                one.append((req, m))
            elif not all(m.accept(t) for t in pending):
                refused.append(req.request_id)
        if one:
            accepted = self.grammar.accept_batch([m for _, m in one], [r.output_token_ids[-1] for r, _ in one])
            refused += [r.request_id for (r, _), ok in zip(one, accepted) if not ok]
        for rid in refused:
            logger.warning("request %s: a token outside its grammar; ending it", rid)
        ended = [r.request_id for r in requests
                 if r.request_id in self._matchers and r.request_id not in refused
                 and self._matchers[r.request_id].is_terminated()]
        return refused, ended

    def prepare(self, requests: Sequence[Request]) -> None:
        """Start filling the next masks of the constrained, unfinished ones among `requests` (after `advance`),
        for the step that samples them."""
        self._take_filled()
        live = [(r.request_id, m) for r in requests if not r.is_finished
                and (m := self._matchers.get(r.request_id)) is not None]
        if live:
            self._filling = self._fill_thread.submit(self._fill_ahead, live)

    def _fill_ahead(self, live: list[tuple[str, Matcher]]) -> _FilledMasks:
        matchers = [m for _, m in live]
        return _FilledMasks({rid: (i, m.num_accepted) for i, (rid, m) in enumerate(live)}, self._fill(matchers))

    def _take_filled(self) -> _FilledMasks | None:
        """The masks being filled ahead, once done (None if none are)."""
        filling, self._filling = self._filling, None
        return filling.result() if filling is not None else None

    def _fill(self, matchers: Sequence[Matcher]) -> torch.Tensor:
        """One bitmask row per matcher, in order."""
        bitmask = torch.empty((len(matchers), words_per_row(self.vocab_size)), dtype=torch.int32)
        live: list[Matcher] = []
        live_rows: list[int] = []
        for j, m in enumerate(matchers):
            if m.is_terminated():
                m.fill(bitmask, j)
            else:
                live.append(m)
                live_rows.append(j)
        if live:
            self.grammar.fill_batch(live, bitmask, live_rows)
        return bitmask

    def bitmask(self, requests: Sequence[Request]) -> TokenMask | None:
        """The allowed next tokens of the constrained ones among `requests` (the step's sampled rows, in order);
        None when none is constrained. Rows filled ahead (`prepare`) are taken as they are; the rest are filled
        now."""
        filled = self._take_filled()
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        reqs = [requests[i] for i in rows]
        behind = [r for r in reqs if self._matchers[r.request_id].num_accepted != len(r.output_token_ids)]
        if behind:  # every sampled token goes through the engine's advance before the next step's mask
            raise RuntimeError(f"structured outputs: the grammar of {behind[0].request_id} has not accepted all its "
                               "output tokens before its next step")
        ready = [filled.row_of(r.request_id, len(r.output_token_ids)) if filled is not None else None for r in reqs]
        if all(i is not None for i in ready):
            if ready == list(range(filled.bitmask.shape[0])):
                return TokenMask(rows, filled.bitmask)
            return TokenMask(rows, filled.bitmask[torch.tensor(ready)])
        missing = [j for j, i in enumerate(ready) if i is None]
        bitmask = torch.empty((len(rows), words_per_row(self.vocab_size)), dtype=torch.int32)
        bitmask[missing] = self._fill([self._matchers[reqs[j].request_id] for j in missing])
        have = [j for j, i in enumerate(ready) if i is not None]
        if have:
            bitmask[have] = filled.bitmask[torch.tensor([ready[j] for j in have])]
        return TokenMask(rows, bitmask)

    def close(self) -> None:
        self._fill_thread.shutdown(wait=False, cancel_futures=True)
