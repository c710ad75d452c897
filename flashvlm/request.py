"""Request-level data: sampling parameters, multimodal items, engine-side request state, outputs."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flashvlm.pruning.setting import TokenPruning
    from flashvlm.structured.params import StructuredOutputsParams


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message names the problem. Other requests are unaffected."""


GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily. Dividing float32 logits by a tiny temperature overflows to inf
(1e-39 is subnormal; anything under ~1e-38 turns logits of a few units into inf and the softmax into NaN), and
already at 1e-5 a logit gap of 1e-3 is a factor e^-100 in probability, so sampling is the argmax except for
near-exact ties: nothing is lost by switching to argmax, and 1e-5 leaves logits up to ~1e33 finite. The same
cut-off as the server's request parsing (and vLLM's)."""

MAX_LOGPROBS = 20
"""Most top log-probabilities one request may ask for per token (OpenAI's top_logprobs bound, vLLM's default)."""

MAX_NUM_SAMPLES = 16
"""Largest SamplingParams.n: the samples share the prompt's KV, but each holds a sequence of its own in the batch."""


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 (or anything below GREEDY_TEMPERATURE) means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    """Return, for every output token, its log-probability and those of the `logprobs` most likely tokens
    (0: the sampled token's only); None: no log-probabilities. Taken from the model's raw logits, before
    repetition penalty, temperature and the top-k/p filters, as vLLM does."""
    n: int = 1
    """Completions to generate for the prompt (1..MAX_NUM_SAMPLES). The prompt is computed once and its KV blocks
    shared by the samples; with a `seed`, sample i draws from `sample_seed(seed, i)`."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, any JSON object, a regex, a choice of strings or an EBNF grammar
    (flashvlm/structured/params.py; a dict of its fields is accepted). Needs `pip install flashvlm[structured]`."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):
            from flashvlm.structured.params import StructuredOutputsParams

            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self.validate()

    @property
    def greedy(self) -> bool:
        # Not `== 0`: a tiny positive temperature would turn the sampler's logits into inf/NaN.
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0.0:
            raise bad(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0.0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_NUM_SAMPLES:
            raise bad(f"n must be an integer in [1, {MAX_NUM_SAMPLES}], got {self.n!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_outputs is not None:
            from flashvlm.structured.params import StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise bad("structured_outputs must be StructuredOutputsParams (or a dict of its fields), got "
                          f"{type(self.structured_outputs).__name__}")
            # Frozen and validated when built: not again here, which dataclasses.replace (one per sample) re-runs.


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request with n > 1: sample 0 keeps the request's seed (so it repeats
    the n=1 request), the others get a 63-bit digest of (seed, index), so no two samples, and no sample and another
    request's plain seed, are likely to share draws."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class MMItem:
    """One preprocessed image of a request, with where its placeholder tokens sit in the prompt."""

    mm_hash: str
    """Content hash of decoded pixels + size + processor parameters; the key of the caches."""
    pixel_values: Any
    """Model-ready tensor, or compact pixels that `pixel_decoder` finishes; its shape is the family's (Qwen:
    (patches, C*T*P*P), CLIP: (C, H, W))."""
    offset: int = 0
    """Index of the first placeholder token in the prompt."""
    num_tokens: int = 0
    """Number of placeholder tokens: the embeddings the vision tower yields, or those kept of them when the item
    is pruned."""
    layout: Any = None
    """What the family's vision tower needs beyond the pixels, written and read only by that family (Qwen: the
    (t, h, w) grid in patches; LLaVA-1.5: None). Hashable: with the pixels' shape and num_tokens it is the item's
    shape key (the runner keys vision graphs on it)."""
    pruning: TokenPruning | None = None
    """Set when only some of the tower's tokens enter the prompt (`num_tokens` of `pruning.num_full_tokens`);
    None: every one does, exactly as without pruning."""
    image_size: tuple[int, int] = (0, 0)
    """Original (width, height), for reporting."""
    frame: tuple[int, int] | None = None
    """Set on a video's temporal patch whose prompt positions continue its video's run (Qwen2-VL, Qwen2.5-VL):
    (its index in the video, the M-RoPE time interval between patches). Not part of the shape key."""
    pixel_decoder: Callable[[Any], Any] | None = None
    """Set when pixel_values are compact (Qwen's host path: the resized uint8 image): turns them, on whatever
    device they are, into the model-ready floats (patchify, normalize). The runner applies it on the GPU."""

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def encoder_tokens(self) -> int:
        """Embeddings the vision tower yields for the item (what the encoder cache holds)."""
        return self.num_tokens if self.pruning is None else self.pruning.num_full_tokens

    def model_pixels(self, device: Any = None) -> Any:
        """pixel_values as the vision tower takes them (on `device`, if given)."""
        pixels = self.pixel_values if device is None else self.pixel_values.to(device, non_blocking=True)
        return pixels if self.pixel_decoder is None else self.pixel_decoder(pixels)

    def finished(self, device: Any) -> MMItem:
        """This item with model-ready pixels on `device` (itself when they already are model-ready)."""
        if self.pixel_decoder is None:
            return self
        return replace(self, pixel_values=self.model_pixels(device), pixel_decoder=None)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """Engine-side request state. The scheduler owns it; the runner only reads it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    mm_items: list[MMItem] = field(default_factory=list)
    priority: int = 0
    arrival_time: float = field(default_factory=time.time)
    eos_token_ids: tuple[int, ...] = ()
    group: str | None = None
    """Scheduling group (the server's SLA tier), for SchedulerConfig.max_running_per_group."""
    parent_id: str | None = None
    """Set on the samples of a request with n > 1: the id the caller gave (sample 0 carries that id itself, sample
    i the id `f"{parent_id}#{i}"`). The scheduler holds a sibling back while another computes their shared prompt."""

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at first admission."""
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: int | str | None = None
    # Stage accounting for latency attribution (seconds); see Request.stage_times().
    preprocess_s: float = 0.0
    first_scheduled_time: float | None = None
    vision_s: float = 0.0
    detokenize_s: float = 0.0

    def stage_times(self) -> dict[str, float]:
        """E2E split into consecutive stages that add up to finish - arrival:
        preprocess, queue (ready -> first scheduled), vision (encoder time of its images),
        prefill (rest of first scheduled -> first token), decode (first token -> finish, less
        detokenize), detokenize (host time turning its tokens into text)."""
        if self.first_token_time is None or self.finish_time is None or self.first_scheduled_time is None:
            return {}
        ready = self.arrival_time + self.preprocess_s
        return {
            "preprocess": self.preprocess_s,
            "queue": max(0.0, self.first_scheduled_time - ready),
            "vision": self.vision_s,
            "prefill": max(0.0, self.first_token_time - self.first_scheduled_time - self.vision_s),
            "decode": max(0.0, self.finish_time - self.first_token_time - self.detokenize_s),
            "detokenize": self.detokenize_s,
        }

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities (natural log, float32 log-softmax of the raw logits) at one output position."""

    token_id: int
    """The token sampled there."""
    logprob: float
    """Its log-probability."""
    top: tuple[tuple[int, float], ...] = ()
    """The SamplingParams.logprobs most likely (token id, log-probability) pairs, most likely first."""


@dataclass
class CompletionOutput:
    """One of a request's n completions (samples)."""

    index: int
    """0..n-1: the sample's place in RequestOutput.outputs (the OpenAI choice index)."""
    token_ids: list[int]
    text: str
    finish_reason: str | None
    """'stop' | 'length' | 'abort', None while running."""
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    """One entry per token of `token_ids` when SamplingParams.logprobs is set; None otherwise."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state so far: its prompt, once, and its SamplingParams.n completions in `outputs`. The
    completion fields (`text`, `token_ids`, `finish_reason`, `stop_reason`, `logprobs`) read the first
    completion: the whole answer of an n=1 request."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float
    first_token_time: float | None
    """When the first token of any completion was sampled."""
    finish_time: float | None
    """When the last completion finished."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV the first sample found in the prefix cache (the others share the prompt it
    computed)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds per pipeline stage, filled when the request finishes (see Request.stage_times; with n > 1, those of
    the sample that finished last)."""
    num_image_tokens: int = 0
    """Image tokens of the prompt as the vision tower yields them (before pruning)."""
    num_image_tokens_kept: int = 0
    """Of those, the tokens the language model saw (all of them unless pruned)."""

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, over all completions."""
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs
