"""Every constrained request's matcher, in step with the request's output tokens.

One owner of the grammar state: the engine adds a request's matcher when it accepts the request (`add`: the
compile error, if any, is that request's 400), advances it after each step's update (`advance`) and drops it when
the request finishes (`drop`); the runner asks for the step's bitmask (`bitmask`). A matcher has accepted exactly
the request's output tokens: `advance` accepts `output_token_ids[num_accepted:]`, so a token is accepted once
whatever path produced it, and a preempted request (recomputed, its output tokens kept) needs no replay. Should a
matcher ever be ahead of its request's tokens, it is reset and replayed from them.

Filling a step's masks is the grammar's largest host cost: one batched xgrammar call per step, on xgrammar's own
C++ threads with the GIL released (0.23 ms for 32 rows of a regex over a 152k vocabulary, on 2 cores). It runs on
the engine thread when the step's tokens are chosen, while the GPU computes that step's forward
(runner/lookahead.py). A Python thread of our own that filled ahead was slower: each of its Python steps had to
win the GIL from the engine thread, so on the H200 host its fill took 1.4 ms and the engine waited for most of it
(docs/BENCHMARKS.md). The masks go to a GPU from pinned memory, so their copy is queued behind the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
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


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...],
                 pin_memory: bool = False) -> None:
        self.grammar = GrammarEngine(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self.pin_memory = pin_memory
        """Fill the masks in pinned host memory (the engine's device is a GPU)."""
        self._matchers: dict[str, Matcher] = {}

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

    def _fill(self, matchers: Sequence[Matcher]) -> torch.Tensor:
        """One bitmask row per matcher, in order."""
        bitmask = torch.empty((len(matchers), words_per_row(self.vocab_size)), dtype=torch.int32,
                              pin_memory=self.pin_memory)
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
        None when none is constrained."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        reqs = [requests[i] for i in rows]
        behind = [r for r in reqs if self._matchers[r.request_id].num_accepted != len(r.output_token_ids)]
        if behind:  # every sampled token goes through the engine's advance before the next step's mask
            raise RuntimeError(f"structured outputs: the grammar of {behind[0].request_id} has not accepted all its "
                               "output tokens before its next step")
        return TokenMask(rows, self._fill([self._matchers[r.request_id] for r in reqs]))
