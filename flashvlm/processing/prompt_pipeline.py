"""Prompt preprocessing for asyncio callers (the server), where no request may hold up another.

A prompt goes through three stages (InputProcessor.chat_text / prompt_text, image_item, assemble). Text stages
run on a few text threads; every image is loaded, decoded and resized on the `ImagePool`, in the request's own
session (a fair share of the workers) and within the request's `ImageBudget`. A prompt without images never
touches the image pool, and text threads never wait for an image, so text-only requests (and requests whose
images are done) go on while other requests' images decode.
"""

from __future__ import annotations

import asyncio
import functools
import io
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from flashvlm.processing.image_pool import ImagePool, ImageSession
from flashvlm.processing.input_processor import InputProcessor, ProcessedPrompt, PromptText
from flashvlm.request import InvalidRequestError, MMItem

T = TypeVar("T")

ImageLoader = Callable[[Any, int], Any]
"""(image source, index) -> what InputProcessor decodes (bytes, an array ...): the server's media policy (file
reads, base64, byte limits). Runs on the image pool."""


@dataclass(frozen=True)
class ImageBudget:
    """What one request's images may cost; None: no bound."""

    max_pixels: int | None = None
    """Width x height summed over the request's images, read from their headers before any is decoded."""
    max_decode_s: float | None = None
    """Worker seconds spent decoding and resizing the request's images, summed; checked as each image is done
    (one image's decode is never cut off: max_image_pixels bounds it)."""


NO_BUDGET = ImageBudget()


class ImageBudgetError(InvalidRequestError):
    """A request whose images pass its ImageBudget; `limit` names the field ('max_pixels' or 'max_decode_s')."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class PromptPipeline:
    """Owns the text threads and the image pool of one InputProcessor."""

    def __init__(self, processor: InputProcessor, text_threads: int = 2, image_threads: int | None = None,
                 image_decodes_per_request: int | None = None) -> None:
        self.processor = processor
        self._text = ThreadPoolExecutor(max_workers=max(1, text_threads), thread_name_prefix="flashvlm-text")
        self.images = ImagePool(image_threads, image_decodes_per_request)

    async def run_text(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Blocking host work that is not image work, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._text, functools.partial(fn, *args, **kwargs))

    async def process(self, prompt: str | dict[str, Any], mm_processor_kwargs: dict | None = None,
                      load: ImageLoader | None = None, budget: ImageBudget = NO_BUDGET) -> ProcessedPrompt:
        return await self._run(functools.partial(self.processor.prompt_text, prompt, mm_processor_kwargs),
                               load, budget)

    async def process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None = None,
                           chat_template: str | None = None, add_generation_prompt: bool = True,
                           load: ImageLoader | None = None, budget: ImageBudget = NO_BUDGET,
                           tools: list[dict] | None = None) -> ProcessedPrompt:
        return await self._run(functools.partial(self.processor.chat_text, messages, mm_processor_kwargs,
                                                 chat_template, add_generation_prompt, tools), load, budget)

    def shutdown(self) -> None:
        self._text.shutdown(wait=False, cancel_futures=True)
        self.images.shutdown()

    # ---- stages -----------------------------------------------------------------------------
    async def _run(self, text_stage: Callable[[], PromptText], load: ImageLoader | None,
                   budget: ImageBudget) -> ProcessedPrompt:
        arrival, t0 = time.time(), time.perf_counter()
        text = await self.run_text(text_stage)
        items: list[MMItem] = []
        if text.images or text.videos:
            with self.images.session() as session:
                items = await self._image_items(session, text, load, budget) if text.images else []
                if text.videos:  # assembling decodes the videos' frames: on the image pool, in the request's share
                    [processed] = await _all(session, [functools.partial(self.processor.assemble, text, items)])
                else:
                    processed = self.processor.assemble(text, items)
        else:
            processed = self.processor.assemble(text, items)  # a walk over the token ids: no pool hop
        processed.arrival_time, processed.preprocess_s = arrival, time.perf_counter() - t0
        return processed

    async def _image_items(self, session: ImageSession, text: PromptText, load: ImageLoader | None,
                           budget: ImageBudget) -> list[MMItem]:
        def load_one(src: Any, index: int) -> tuple[Any, int]:
            source = load(src, index) if load is not None else src
            return source, _pixels(source)

        loaded = await _all(session, [functools.partial(load_one, src, i) for i, src in enumerate(text.images)])
        if budget.max_pixels is not None:
            total = sum(pixels for _, pixels in loaded)
            if total > budget.max_pixels:
                raise ImageBudgetError(f"the {len(loaded)} images of this request hold {total} pixels in all; the "
                                       f"limit per request is {budget.max_pixels} pixels", "max_pixels")

        def decode_one(source: Any, index: int) -> tuple[MMItem, float]:
            t0 = time.perf_counter()
            item = self.processor.image_item(source, text, index)
            return item, time.perf_counter() - t0

        spent = 0.0

        def charge(result: tuple[MMItem, float]) -> None:
            nonlocal spent
            spent += result[1]
            if budget.max_decode_s is not None and spent > budget.max_decode_s:
                raise ImageBudgetError(f"decoding and resizing this request's images took more than "
                                       f"{budget.max_decode_s:g} s of worker time; send fewer or smaller images",
                                       "max_decode_s")

        done = await _all(session, [functools.partial(decode_one, source, i) for i, (source, _) in enumerate(loaded)],
                          charge)
        return [item for item, _ in done]


async def _all(session: ImageSession, calls: list[Callable[[], T]],
               after_each: Callable[[T], None] | None = None) -> list[T]:
    """Run `calls` in the session; their results in order. The first error (or an error of `after_each`, called
    as each result arrives) cancels the jobs not started and is raised."""
    futures = [asyncio.wrap_future(session.submit(call)) for call in calls]
    try:
        pending = set(futures)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=futures.index):
                result = future.result()
                if after_each is not None:
                    after_each(result)
        return [future.result() for future in futures]
    finally:
        session.close()
        for future in futures:
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # read, so asyncio does not log it as never retrieved


def _pixels(source: Any) -> int:
    """Width x height of an image source without decoding it: encoded bytes by their header, arrays and PIL images
    by their shape; 0 for sources read elsewhere (a path or data URI handed to the engine as it is)."""
    if isinstance(source, np.ndarray):
        return int(source.shape[0] * source.shape[1]) if source.ndim >= 2 else 0
    if isinstance(source, Image.Image):
        return source.width * source.height
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(source)) as img:
                    return img.width * img.height
        except Exception:
            return 0  # not an image: decoding refuses it with the reason
    return 0
