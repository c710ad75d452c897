"""The transformers baseline: the same workload through `generate` on the same model, timed the same way.

Inputs go through flashvlm's own input processor, so both systems see identical token ids and pixels;
the baseline's TTFT includes that preprocessing, as ours does. Tokens are timed with a streamer.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flashvlm.bench.records import BenchRequest, RequestRecord, ScenarioResult
from flashvlm.config import ModelConfig
from flashvlm.models.loader import read_checkpoint
from flashvlm.processing.input_processor import InputProcessor, ProcessedPrompt

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _TokenClock:
    """A transformers streamer that only records when each generation step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.times.append(time.time())

    def end(self) -> None:
        pass


class TransformersBaseline:
    label = "transformers"

    def __init__(self, model_path: str, *, dtype: str = "bfloat16", device: str = "cuda",
                 load_format: str = "auto", seed: int = 0) -> None:
        self.device = device
        self.dtype = _DTYPES["float32" if dtype == "auto" and device == "cpu" else
                             ("bfloat16" if dtype == "auto" else dtype)]
        self.checkpoint = read_checkpoint(ModelConfig(model=model_path))
        cfg = self.checkpoint.hf_config
        self.family = self.checkpoint.family
        cls = self.family.baseline_model_class()
        torch.manual_seed(seed)
        if load_format == "dummy":
            with torch.device(device):
                self.model = cls._from_config(cfg, dtype=self.dtype, attn_implementation="sdpa")
        else:
            self.model = cls.from_pretrained(model_path, dtype=self.dtype, attn_implementation="sdpa").to(device)
        self.model.eval()
        image_token = getattr(cfg, "image_token_id", None)
        if image_token is None:
            image_token = cfg.image_token_index
        self.image_token_id = int(image_token)
        text_cfg = getattr(cfg, "text_config", cfg)
        self.processor = InputProcessor(self.checkpoint, text_cfg.vocab_size, self.image_token_id)
        tok = self.checkpoint.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.config = {"system": "transformers", "model": model_path, "dtype": str(self.dtype), "device": device,
                       "attn_implementation": "sdpa", "load_format": load_format, "seed": seed}

    # ---- inputs ----------------------------------------------------------------------------------
    def _process(self, req: BenchRequest) -> ProcessedPrompt:
        return self.processor.process(req.engine_prompt())

    def _batch_inputs(self, prompts: list[ProcessedPrompt]) -> dict[str, Any]:
        """Left-padded batch in the layout the transformers model classes take."""
        longest = max(len(p.prompt_token_ids) for p in prompts)
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            n = len(p.prompt_token_ids)
            ids[i, longest - n:] = torch.tensor(p.prompt_token_ids)
            mask[i, longest - n:] = 1
        inputs: dict[str, Any] = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        video = self.processor.video_inputs
        images, frames = [], []
        for p in prompts:  # a video's frame items start with its video token
            for it in p.mm_items:
                is_frame = video is not None and p.prompt_token_ids[it.offset] == video.video_token_id
                (frames if is_frame else images).append(it)
        mm_inputs = {}
        if images:
            mm_inputs = self.family.baseline_image_inputs(images, ids, mask, self.image_token_id, self.device)
        if frames:
            mm_inputs.update(video.baseline_inputs(frames, ids, mask, self.image_token_id, self.device))
        # Pixels in the model's dtype; Qwen2.5-VL's time steps stay float32, as positions are computed from them.
        inputs.update({k: v.to(self.device, self.dtype) if v.is_floating_point() and k != "second_per_grid_ts"
                       else v for k, v in mm_inputs.items()})
        return inputs

    def _generate(self, inputs: dict[str, Any], max_tokens: int) -> _TokenClock:
        clock = _TokenClock()
        with torch.inference_mode():
            self.model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=self.pad_id, streamer=clock)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        clock.times[-1:] = [time.time()]  # the last step's tokens are ready only after the sync
        return clock

    # ---- scenarios -------------------------------------------------------------------------------
    def warm_up(self, requests: list[BenchRequest], n: int = 1) -> None:
        for req in requests[:n]:
            self._generate(self._batch_inputs([self._process(req)]), 2)

    def _record(self, req: BenchRequest, p: ProcessedPrompt, start: float, clock: _TokenClock) -> RequestRecord:
        times = clock.times
        ttft = times[0] - start
        e2e = times[-1] - start
        ready = p.arrival_time + p.preprocess_s
        return RequestRecord(request_id=req.request_id, prompt_tokens=len(p.prompt_token_ids),
                             output_tokens=len(times), num_images=len(req.images), start_time=start, ttft=ttft,
                             e2e=e2e, itl=[b - a for a, b in zip(times[:-1], times[1:])],
                             stages={"preprocess": p.preprocess_s, "queue": max(0.0, ready - start - p.preprocess_s),
                                     "prefill": times[0] - ready, "decode": times[-1] - times[0]})

    def run_latency(self, requests: list[BenchRequest], workload: dict, progress=None) -> ScenarioResult:
        records = []
        self._reset_peak()
        t0 = time.perf_counter()
        for req in requests:
            start = time.time()
            p = self._process(req)
            records.append(self._record(req, p, start, self._generate(self._batch_inputs([p]), req.max_tokens)))
            if progress:
                progress(1)
        return self._result("latency", workload, records, time.perf_counter() - t0)

    def run_throughput(self, requests: list[BenchRequest], workload: dict, batch_size: int = 8,
                       progress=None) -> ScenarioResult:
        """Static batches of batch_size (transformers has no continuous batching); all requests arrive at 0."""
        records = []
        self._reset_peak()
        start = time.time()
        t0 = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            chunk = requests[i:i + batch_size]
            prompts = [self._process(r) for r in chunk]
            clock = self._generate(self._batch_inputs(prompts), max(r.max_tokens for r in chunk))
            records.extend(self._record(r, p, start, clock) for r, p in zip(chunk, prompts))
            if progress:
                progress(len(chunk))
        result = self._result("throughput", workload, records, time.perf_counter() - t0)
        result.config = {**result.config, "batch_size": batch_size}
        return result

    def _reset_peak(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def _result(self, scenario: str, workload: dict, records: list[RequestRecord], duration: float) -> ScenarioResult:
        peak = torch.cuda.max_memory_allocated() if self.device.startswith("cuda") else None
        return ScenarioResult(scenario=scenario, label=self.label, config=dict(self.config), workload=workload,
                              records=records, duration_s=duration, peak_memory_bytes=peak)
