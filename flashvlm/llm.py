"""Offline facade: `LLM(model).generate(prompts)` and `LLM(model).chat(messages)`."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from flashvlm.config import EngineConfig
from flashvlm.engine.engine import Engine
from flashvlm.processing.feeder import OrderedFeeder
from flashvlm.processing.input_processor import ProcessedPrompt
from flashvlm.request import InvalidRequestError, RequestOutput, SamplingParams


class LLM:
    """A vision-language model loaded from a Hugging Face checkpoint folder.

    With `model=None` the embedded default (a tiny Qwen2-VL-architecture model) is used. Every other keyword is
    an engine option (a field of flashvlm/config.py; docs/engine.md lists them all): e.g. `kv_cache_tokens`
    fixes the KV capacity, otherwise on GPU the cache takes what `gpu_memory_utilization` leaves after weights
    and the profiled activation peak; `enable_prefix_caching` reuses the KV of a repeated prefix (images
    included) and `encoder_cache_tokens` is how many image tokens of vision embeddings are kept for reuse
    (docs/caching.md). An unknown keyword is an UnknownOptionError (a TypeError) naming the closest options.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig.from_options(model, **engine_options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM on an engine built from `config` (the CLI builds one from its flags)."""
        llm = cls.__new__(cls)
        llm.engine = Engine(config)
        return llm

    def close(self) -> None:
        """Stop the engine's tensor-parallel worker processes (a no-op at tensor_parallel_size 1)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: str | dict | Sequence[str | dict],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """A prompt is text, `{"prompt": text, "images": [...]}` or `{"prompt_token_ids": [...], "images": [...]}`;
        text carries one image placeholder per image (e.g. <|vision_start|><|image_pad|><|vision_end|>). One
        RequestOutput per prompt, in prompt order, with SamplingParams.n completions in its `outputs`."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run([functools.partial(self.engine.process_prompt, p) for p in prompts], sampling_params,
                         priority, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template: str | None = None, mm_processor_kwargs: dict | None = None,
             use_tqdm: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        """OpenAI-style messages (one conversation or a list of them); content parts `text`,
        `image_url` ({"url": data URI or file path}) and `image` (PIL image, array, path or bytes). `tools`
        (OpenAI's function definitions) are rendered into the prompt; the output is the model's text
        (flashvlm.server.tool_calls.parse_tool_calls reads calls out of it)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        jobs = [functools.partial(self.engine.process_chat, c, chat_template=chat_template,
                                  mm_processor_kwargs=mm_processor_kwargs, tools=tools) for c in conversations]
        return self._run(jobs, sampling_params, None, use_tqdm)

    def _run(self, jobs: list[Callable[[], ProcessedPrompt]], sampling_params: Any, priority: Sequence[int] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        """Preprocess the prompts (images: decode, hash, resize, patchify) on a few threads while the engine
        already runs the first ones; requests are added in prompt order as their preprocessing ends (with
        priorities, all are added before the first step, so the order among them holds). A prompt that fails
        preprocessing aborts those already added and raises."""
        n = len(jobs)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.engine.default_sampling_params()] * n
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise InvalidRequestError(f"{len(params)} sampling params for {n} prompts")
        if priority is not None and len(priority) != n:
            raise InvalidRequestError(f"{len(priority)} priorities for {n} prompts")
        for p in params:  # every parameter is checked before any prompt is queued
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            p.validate()
            self.engine.structured.check(p.structured_outputs)
        ids: dict[str, None] = {}  # ours, in prompt order (a dict: order and O(1) membership)

        def add(k: int, result: Callable[[], ProcessedPrompt]) -> None:
            req = self.engine.add_processed(result(), params[k], priority=priority[k] if priority else 0)
            ids[req.request_id] = None

        with OrderedFeeder(jobs, add, all_at_once=priority is not None, backlog=self.engine.waiting_work,
                           step_tokens=self.engine.config.scheduler.max_num_batched_tokens) as feeder:
            return self._drain(feeder, ids, use_tqdm)

    def _drain(self, feeder: OrderedFeeder, ids: dict[str, None], use_tqdm: bool) -> list[RequestOutput]:
        n = len(feeder.jobs)
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=n, desc="generating", unit="req")
        try:
            while len(finals) < n:
                feeder.feed(block=not self.engine.has_unfinished_requests())
                for out in self.engine.step():
                    if out.finished and out.request_id in ids and out.request_id not in finals:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in finals:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[i] for i in ids]
