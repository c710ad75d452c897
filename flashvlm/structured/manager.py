"""Every constrained request's matcher, in step with the request's output tokens.

One owner of the grammar state: the engine adds a request's matcher when it accepts the request (`add`: the
compile error, if any, is that request's 400), advances it after each step's update (`advance`) and drops it when
the request finishes (`drop`); the runner asks for the step's bitmask (`bitmask`). A matcher has accepted exactly
the request's output tokens: `advance` accepts `output_token_ids[num_accepted:]`, so a token is accepted once
whatever path produced it, and a preempted request (recomputed, its output tokens kept) needs no replay. Should a
matcher ever be ahead of its request's tokens, it is reset and replayed from them.
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
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        self.grammar = GrammarEngine(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
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

    def advance(self, req: Request) -> bool:
        """Accept the request's output tokens its matcher has not seen; False if the grammar refused one (the
        caller ends the request). True for an unconstrained request."""
        m = self._matchers.get(req.request_id)
        if m is None:
            return True
        tokens = req.output_token_ids
        if m.num_accepted > len(tokens):
            m.reset()
        for t in tokens[m.num_accepted:]:
            if not m.accept(t):
                logger.warning("request %s: token %d is outside its grammar; ending it", req.request_id, t)
                return False
        return True

    def ended(self, req: Request) -> bool:
        """Whether a constrained request's grammar has ended (its stop token accepted)."""
        m = self._matchers.get(req.request_id)
        return m is not None and m.is_terminated()

    def bitmask(self, requests: Sequence[Request]) -> TokenMask | None:
        """The allowed next tokens of the constrained ones among `requests` (the step's sampled rows, in order);
        None when none is constrained."""
        rows = [i for i, r in enumerate(requests) if r.request_id in self._matchers]
        if not rows:
            return None
        bitmask = torch.full((len(rows), words_per_row(self.vocab_size)), -1, dtype=torch.int32)
        for j, i in enumerate(rows):
            req = requests[i]
            self.advance(req)  # a no-op unless a token reached the request without the engine's update
            self._matchers[req.request_id].fill(bitmask, j)
        return TokenMask(rows, bitmask)
