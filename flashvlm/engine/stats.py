"""Per-step statistics the engine can record (benchmarks switch it on with Engine.step_log = [])."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from flashvlm.engine.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from flashvlm.runner.timing import StepTimings


@dataclass
class StepRecord:
    """One engine step: its size and where the time went (GPU times from CUDA events).

    Device times are event spans on the stream: under the decode lookahead a step reports the previous
    lookahead's span (the one it launched is still running), about one step's device time."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int
    """Prompt tokens computed this step (text and image placeholders; a preempted request's recompute too)."""
    num_decode_tokens: int
    """One per decoding sequence: also the decode batch size."""
    num_images: int
    """Images the vision tower encoded this step."""
    host_s: float
    """Host time of the whole step (schedule + inputs + launch + sync + update): the step's wall time."""
    vision_s: float
    forward_s: float
    """Device time of the language-model forward and sampling."""
    start_s: float = 0.0
    """time.perf_counter() when the step began; benchmark runs rebase it to seconds since the run started."""
    num_prefill_image_tokens: int = 0
    """Of num_prefill_tokens, those on image placeholders (their embeddings come from the vision tower)."""
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    num_image_patches: int = 0
    """Patches the vision tower ran for this step's images."""
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    """Host time building the step's inputs (the runner's plan)."""
    update_s: float = 0.0
    """Host time after the device work: scheduler update, detokenizing, outputs."""

    @property
    def num_prefill_text_tokens(self) -> int:
        return self.num_prefill_tokens - self.num_prefill_image_tokens

    @property
    def device_s(self) -> float:
        """GPU busy time of the step: vision tower plus language model."""
        return self.vision_s + self.forward_s

    @property
    def gpu_idle_s(self) -> float:
        """Step wall time the GPU had nothing of this step to run (clamped at 0: lookahead steps overlap)."""
        return max(0.0, self.host_s - self.device_s)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def record_step(out: SchedulerOutput, timings: StepTimings, *, start: float, end: float, schedule_s: float,
                update_s: float, image_patches: int) -> StepRecord:
    """The record of a step that ran `out` from `start` to `end` (perf_counter). Decode = one new token past the
    prompt; everything else is prefill, its image tokens those inside the placeholder ranges it covers."""
    prefill = prefill_image = decode = prefill_seqs = 0
    for s in out.scheduled:
        req = s.request
        if s.num_new_tokens == 1 and s.start >= req.num_prompt_tokens:
            decode += 1
            continue
        prefill += s.num_new_tokens
        prefill_seqs += 1
        for item in req.mm_items:
            prefill_image += max(0, min(s.end, item.end) - max(s.start, item.offset))
    return StepRecord(
        num_seqs=len(out.scheduled), num_tokens=prefill + decode, num_prefill_tokens=prefill,
        num_decode_tokens=decode, num_images=timings.num_images, host_s=end - start, vision_s=timings.vision_s,
        forward_s=timings.forward_s, start_s=start, num_prefill_image_tokens=prefill_image,
        num_prefill_seqs=prefill_seqs, num_decode_seqs=decode, num_image_patches=image_patches,
        schedule_s=schedule_s, prepare_s=timings.prepare_s, update_s=update_s)
