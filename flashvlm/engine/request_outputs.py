"""The engine's output state of one request: its samples (SamplingParams.n of them, each a scheduler request with a
detokenizer and its log-probabilities), and the RequestOutput it reports, one per request whatever n is."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashvlm.engine.detokenizer import IncrementalDetokenizer
from flashvlm.request import CompletionOutput, Request, RequestOutput, SamplingParams, TokenLogprobs, sample_seed


def sample_request_id(request_id: str, index: int) -> str:
    """The scheduler's id of sample `index`: sample 0 keeps the request's id, so an n=1 request is unchanged."""
    return request_id if index == 0 else f"{request_id}#{index}"


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """What one sample of an n-request runs with: n=1, and with a seed, that sample's own (request.sample_seed)."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else sample_seed(params.seed, index)
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass
class Sample:
    """One completion in the making."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None = None
    """One entry per output token when the request asks for log-probabilities (SamplingParams.logprobs)."""
    done: bool = False
    """Finished, and its detokenizer flushed: its completion no longer changes."""

    def completion(self) -> CompletionOutput:
        req = self.request
        return CompletionOutput(index=self.index, token_ids=list(req.output_token_ids), text=self.detokenizer.text,
                                finish_reason=req.status.value if req.is_finished else None,
                                stop_reason=req.stop_reason,
                                logprobs=None if self.logprobs is None else list(self.logprobs))


class TrackedRequest:
    """A request the engine reports on: its samples, in index order."""

    def __init__(self, request_id: str, samples: list[Sample]) -> None:
        self.request_id = request_id
        self.samples = samples

    @property
    def finished(self) -> bool:
        return all(s.done for s in self.samples)

    def unfinished(self) -> list[Sample]:
        return [s for s in self.samples if not s.done]

    def output(self, final: bool = False) -> RequestOutput:
        """The RequestOutput so far; `final`: with the stage times (of the sample that finished last)."""
        first = self.samples[0].request
        reqs = [s.request for s in self.samples]
        token_times = [r.first_token_time for r in reqs if r.first_token_time is not None]
        finish_times = [r.finish_time for r in reqs if r.finish_time is not None]
        out = RequestOutput(request_id=self.request_id, prompt_token_ids=first.prompt_token_ids,
                            outputs=[s.completion() for s in self.samples], arrival_time=first.arrival_time,
                            first_token_time=min(token_times) if token_times else None,
                            finish_time=max(finish_times) if len(finish_times) == len(reqs) else None,
                            num_cached_tokens=first.num_cached_tokens,
                            num_image_tokens=sum(it.encoder_tokens for it in first.mm_items),
                            num_image_tokens_kept=sum(it.num_tokens for it in first.mm_items))
        if final:
            last = max(reqs, key=lambda r: r.finish_time or 0.0)
            out.stages = last.stage_times()
        return out
