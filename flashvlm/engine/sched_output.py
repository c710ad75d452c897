"""What the scheduler hands the runner each step, and what the runner hands back."""

from __future__ import annotations

from dataclasses import dataclass, field

from flashvlm.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed this step, starting at request.num_computed_tokens."""
    block_ids: list[int]
    """The request's whole block table after allocation for this step."""
    start: int
    """request.num_computed_tokens when the step was scheduled (frozen: update() advances the request)."""
    samples: bool
    """Whether this step reaches the end of the request's known tokens, so a token is sampled."""

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """In batch order: the runner lays tokens out in this order."""
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    """request_id -> indices into request.mm_items whose embeddings must be computed this step."""
    free_encoder_hashes: list[str] = field(default_factory=list)
    """Embeddings (by mm_hash) no request needs any more; the runner drops them."""
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that left (finished, aborted or preempted) since the last step: runner drops their state."""
    may_admit: bool = False
    """Requests wait and a batch slot is free: the next step may admit one, so the runner launches no decode
    step ahead (it would likely be dropped)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
