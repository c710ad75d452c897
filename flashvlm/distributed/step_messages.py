"""The step message rank 0 broadcasts, in a compact form: a request crosses whole (prompt, images, sampling) the
first step it is scheduled, then only as the output tokens the workers have not seen yet. Each worker keeps a
mirror of the requests the runner reads (request_id, prompt, outputs, images, sampling params)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from flashvlm.engine.sched_output import SchedulerOutput
from flashvlm.request import Request


@dataclass
class RequestUpdate:
    """A request the workers hold already: its output tokens from index `start` on."""

    request_id: str
    start: int
    tokens: list[int]


@dataclass
class StepMessage:
    out: SchedulerOutput
    """The scheduler's output with every ScheduledRequest's `request` set to None (the payloads carry them)."""
    requests: list[Request | RequestUpdate]
    """One per scheduled request, in order."""
    forgotten: list[str]
    """Requests the engine has finished with since the last step (their runner state goes)."""


class StepSender:
    """Rank 0's side: what the workers hold of each request."""

    def __init__(self) -> None:
        self.sent: dict[str, int] = {}
        """Request id -> output tokens the workers have."""

    def message(self, out: SchedulerOutput, forgotten: list[str]) -> StepMessage:
        for rid in forgotten:
            self.sent.pop(rid, None)
        payloads: list[Request | RequestUpdate] = []
        for s in out.scheduled:
            req = s.request
            have = self.sent.get(req.request_id)
            if have is None:
                payloads.append(req)
            else:
                start = min(have, len(req.output_token_ids))
                payloads.append(RequestUpdate(req.request_id, start, req.output_token_ids[start:]))
            self.sent[req.request_id] = len(req.output_token_ids)
        for rid in out.finished_request_ids:  # left the batch: sent whole again if it comes back
            self.sent.pop(rid, None)
        compact = dataclasses.replace(out, scheduled=[dataclasses.replace(s, request=None) for s in out.scheduled])
        return StepMessage(compact, payloads, list(forgotten))


class StepReceiver:
    """A worker's side: the mirrored requests, and the SchedulerOutput rebuilt from a message."""

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def receive(self, message: Any) -> tuple[SchedulerOutput, list[str]]:
        for rid in message.forgotten:
            self.requests.pop(rid, None)
        scheduled = []
        for s, payload in zip(message.out.scheduled, message.requests):
            if isinstance(payload, RequestUpdate):
                req = self.requests[payload.request_id]
                del req.output_token_ids[payload.start:]
                req.output_token_ids.extend(payload.tokens)
            else:
                req = self.requests[payload.request_id] = payload
            scheduled.append(dataclasses.replace(s, request=req))
        for rid in message.out.finished_request_ids:
            self.requests.pop(rid, None)
        return dataclasses.replace(message.out, scheduled=scheduled), message.forgotten
