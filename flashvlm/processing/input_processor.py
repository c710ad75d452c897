"""From a user prompt (text or token ids, plus images) to a `Request`: decode and preprocess images,
hash them, tokenize, and expand each image placeholder to as many tokens as the image yields.

Preprocessed pixels that took work (a resize, GPU preprocessing, CLIP's crop) are kept in a small LRU keyed by
the content hash (which is computed before the resize, from the decoded image and the processor parameters), so
a picture sent again (a follow-up turn, a retry) costs a decode and a hash, not another resize. Pixels that are
one copy of the decoded image are not kept: the copy is cheaper than holding fresh memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from flashvlm.models.loader import Checkpoint
from flashvlm.processing.hashing import hash_image, hash_pixels
from flashvlm.processing.images import load_image, rgb_array
from flashvlm.processing.preprocess import ClipImageProcessor, QwenImageProcessor, get_image_processor
from flashvlm.processing.qwen_grid import largest_qwen_grid, qwen_target_size
from flashvlm.request import InvalidRequestError, MMItem

_IMAGE_PART_TYPES = ("image", "image_url", "input_image")


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    mm_items: list[MMItem]
    arrival_time: float = field(default_factory=time.time)
    """When processing began: the request's arrival as the user sees it."""
    preprocess_s: float = 0.0
    """Host time spent decoding and preprocessing images, templating and tokenizing."""


class PixelCache:
    """Thread-safe LRU of preprocessed images by mm_hash, bounded in bytes (prompts are processed on
    executor threads by the async engine). Cached tensors are shared: nothing may modify them in place."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_hits = 0
        self._entries: OrderedDict[str, tuple[Any, Any, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, mm_hash: str) -> tuple[Any, Any] | None:
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None:
                return None
            self._entries.move_to_end(mm_hash)
            self.num_hits += 1
            return entry[0], entry[1]

    def put(self, mm_hash: str, pixels: Any, grid: Any) -> None:
        size = pixels.numel() * pixels.element_size()
        if size > self.max_bytes:
            return
        with self._lock:
            if mm_hash in self._entries:
                return
            self._entries[mm_hash] = (pixels, grid, size)
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                _, (_, _, dropped) = self._entries.popitem(last=False)
                self.num_bytes -= dropped

    def __len__(self) -> int:
        return len(self._entries)


class InputProcessor:
    """Owns the tokenizer, chat template and image processor of one model."""

    def __init__(self, checkpoint: Checkpoint, vocab_size: int, image_token_id: int,
                 max_images_per_prompt: int = 16, pixel_cache_bytes: int = 256 << 20,
                 preprocess_device: str | None = None) -> None:
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.max_images_per_prompt = max_images_per_prompt
        self.image_processor = get_image_processor(checkpoint.preprocessor_config, checkpoint.model_type)
        self.pixel_cache = PixelCache(pixel_cache_bytes)
        """Preprocessed pixels of recent images; pixel_cache_bytes=0 turns it off."""
        self._image_token = self.tokenizer.convert_ids_to_tokens(image_token_id)
        self.preprocess_device = preprocess_device
        """Where rescale/normalize/patchify run (None: CPU); decoding and resizing always run on the CPU."""

    # ---- prompts -------------------------------------------------------------------------------
    def process(self, prompt: str | dict[str, Any], mm_processor_kwargs: dict | None = None) -> ProcessedPrompt:
        return _timed(self._process, prompt, mm_processor_kwargs)

    def process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None = None,
                     chat_template: str | None = None, add_generation_prompt: bool = True) -> ProcessedPrompt:
        """OpenAI-style messages: content is a string or a list of parts (text, image_url, image)."""
        return _timed(self._process_chat, messages, mm_processor_kwargs, chat_template, add_generation_prompt)

    def _process(self, prompt: str | dict[str, Any], mm_processor_kwargs: dict | None) -> ProcessedPrompt:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidRequestError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "images", "image", "mm_processor_kwargs"}
        if unknown:
            raise InvalidRequestError(f"unknown prompt field(s): {sorted(unknown)}")
        images = prompt.get("images", prompt.get("image", []))
        if not isinstance(images, (list, tuple)):
            images = [images]
        kwargs = {**(mm_processor_kwargs or {}), **(prompt.get("mm_processor_kwargs") or {})}
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(isinstance(i, int) for i in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
            token_ids = list(ids)
        elif "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise InvalidRequestError("prompt must be a string")
            token_ids = self.tokenizer.encode(prompt["prompt"], add_special_tokens=True)
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        return self._attach_images(token_ids, images, kwargs)

    def _process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None, chat_template: str | None,
                      add_generation_prompt: bool) -> ProcessedPrompt:
        template = chat_template or self.checkpoint.chat_template
        if template is None:
            raise InvalidRequestError("this model has no chat template; use generate() with a raw prompt")
        templated, images = self.normalize_messages(messages)
        text = self.tokenizer.apply_chat_template(templated, chat_template=template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._attach_images(token_ids, images, mm_processor_kwargs or {})

    @staticmethod
    def normalize_messages(messages: Any) -> tuple[list[dict], list[Any]]:
        """Messages with image parts reduced to {"type": "image"} (what chat templates test for),
        and the image sources in order of appearance."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        out, images = [], []
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                raise InvalidRequestError(f"messages[{i}] must be an object with 'role' and 'content'")
            content = msg["content"]
            if isinstance(content, str) or content is None:
                out.append({"role": msg["role"], "content": content or ""})
                continue
            if not isinstance(content, list):
                raise InvalidRequestError(f"messages[{i}].content must be a string or a list of parts")
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise InvalidRequestError(f"messages[{i}].content[{j}]: text part needs a 'text' string")
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in _IMAGE_PART_TYPES:
                    images.append(_image_source(part, f"messages[{i}].content[{j}]"))
                    parts.append({"type": "image"})
                else:
                    raise InvalidRequestError(f"messages[{i}].content[{j}]: unsupported content part type "
                                              f"{kind!r} (supported: text, image_url, image)")
            out.append({"role": msg["role"], "content": parts})
        return out, images

    # ---- images --------------------------------------------------------------------------------
    def _attach_images(self, token_ids: list[int], images: list[Any], kwargs: dict) -> ProcessedPrompt:
        if len(images) > self.max_images_per_prompt:
            raise InvalidRequestError(f"{len(images)} images in one prompt; the limit is {self.max_images_per_prompt}")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        items = [self._preprocess(src, kwargs, i) for i, src in enumerate(images)]
        return ProcessedPrompt(self._expand_placeholders(token_ids, items), items)

    def profile_items(self, budget_tokens: int) -> list[MMItem]:
        """Stand-ins for the heaviest vision batch one step can hold, for memory profiling: the largest image
        a request may send (see `largest_qwen_grid`), or as many fixed-size images as the step's token budget
        covers. Pixel values are zeros: only shapes matter."""
        proc = self.image_processor
        if isinstance(proc, QwenImageProcessor):
            grid = largest_qwen_grid(proc)
            patch = 3 * proc.temporal_patch_size * proc.patch_size ** 2
            pixels = torch.zeros(grid[0] * grid[1] * grid[2], patch)
            num_tokens = proc.num_image_tokens(grid)
        else:
            cfg = self.checkpoint.hf_config
            grid = None
            pixels = torch.zeros(3, *proc.crop_hw)
            num_tokens = proc.num_image_tokens(cfg.vision_config.patch_size, cfg.vision_feature_select_strategy)
        item = MMItem(mm_hash="memory-profile", pixel_values=pixels, num_tokens=num_tokens, grid_thw=grid)
        return [item] * max(1, budget_tokens // num_tokens)

    def _preprocess(self, src: Any, kwargs: dict, index: int) -> MMItem:
        try:
            array = rgb_array(src)  # an RGB numpy array stays one while it needs no resize: no PIL round trip
            img = load_image(src) if array is None else None
        except InvalidRequestError as e:
            raise InvalidRequestError(f"image {index}: {e}") from None
        proc = self.image_processor
        if isinstance(proc, QwenImageProcessor):
            mm_hash, pixels, grid, worth_keeping = self._qwen_pixels(proc, img, array, kwargs)
            decoder = proc.decode_compact if pixels.dtype == torch.uint8 else None
            num_tokens = proc.num_image_tokens(grid)
        elif isinstance(proc, ClipImageProcessor):
            if kwargs:
                raise InvalidRequestError(f"this model takes no mm_processor_kwargs, got {sorted(kwargs)}")
            params = proc.processor_params()
            mm_hash = (hash_image(img, params) if array is None
                       else hash_pixels("RGB", array.shape[1], array.shape[0], params, array))
            cached = self.pixel_cache.get(mm_hash)
            if cached is None and array is not None:
                img = Image.fromarray(array)  # only to preprocess: a repeat is found by the array's hash
            pixels, grid = cached if cached is not None else (proc.preprocess(img, device=self.preprocess_device), None)
            worth_keeping = cached is None
            decoder = None
            cfg = self.checkpoint.hf_config
            num_tokens = proc.num_image_tokens(cfg.vision_config.patch_size, cfg.vision_feature_select_strategy)
        else:  # pragma: no cover - get_image_processor only returns the two above
            raise TypeError(type(proc))
        if worth_keeping:
            self.pixel_cache.put(mm_hash, pixels, grid)
        size = (img.width, img.height) if array is None else (array.shape[1], array.shape[0])
        return MMItem(mm_hash=mm_hash, pixel_values=pixels, num_tokens=num_tokens,
                      grid_thw=grid, image_size=size, pixel_decoder=decoder)

    def _qwen_pixels(self, proc: QwenImageProcessor, img: Image.Image | None, array: np.ndarray | None,
                     kwargs: dict) -> tuple[str, torch.Tensor, tuple[int, int, int], bool]:
        """(hash, pixels, grid, worth keeping in the pixel cache) of a picture given as a PIL image or as an RGB
        array. Only pixels that took work (a resize, GPU preprocessing) are kept: without a resize the compact
        pixels are one copy of the decoded ones, cheaper than holding fresh memory whose first touch costs more
        than the copy (2.4 against 0.4 ms a 1008x756 prompt, measured on the host)."""
        unknown = set(kwargs) - {"min_pixels", "max_pixels"}
        if unknown:
            raise InvalidRequestError(f"unknown mm_processor_kwargs {sorted(unknown)} (min_pixels, max_pixels)")
        lo, hi = kwargs.get("min_pixels"), kwargs.get("max_pixels")
        params = proc.processor_params(lo, hi)  # validates the overrides
        height, width = array.shape[:2] if array is not None else (img.height, img.width)
        resized = qwen_target_size(proc, height, width, lo, hi) != (height, width)
        # The RGB bytes (load_image always gives RGB), read once for the hash and, without a resize, the pixels.
        raw = array if array is not None else img.tobytes()
        mm_hash = hash_pixels("RGB", width, height, params, raw)
        cached = self.pixel_cache.get(mm_hash)
        if cached is not None:
            return mm_hash, *cached, False
        if not resized and self.preprocess_device is None:  # already the compact image: the runner finishes it
            # A bytearray copy: torch wants writable memory, and an array's owner may reuse it.
            pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(height, width, 3)
            return mm_hash, pixels, (1, height // proc.patch_size, width // proc.patch_size), False
        if array is not None:
            img = Image.fromarray(array)  # resized like any other picture
        if self.preprocess_device is None:  # the compact uint8 image; the runner finishes it on its device
            return mm_hash, *proc.preprocess_compact(img, min_pixels=lo, max_pixels=hi), True
        return mm_hash, *proc.preprocess(img, min_pixels=lo, max_pixels=hi, device=self.preprocess_device), True

    def _expand_placeholders(self, token_ids: list[int], items: list[MMItem]) -> list[int]:
        """Each placeholder token stands for one image and is expanded, as HF's processors do, even when
        placeholders sit back to back. A prompt already expanded (runs made of whole images' token counts, in
        order) is accepted as it is."""
        tok = self.image_token_id
        runs = _runs_of(token_ids, tok)
        count = sum(length for _, length in runs)
        if count == len(items):
            starts = [i for start, length in runs for i in range(start, start + length)]
            return self._expand_each(token_ids, starts, items)
        offsets = _expanded_offsets(runs, items)
        if offsets is None:
            raise InvalidRequestError(
                f"prompt has {count} image placeholder token(s) {self._image_token!r} (in runs of "
                f"{[length for _, length in runs]}) but {len(items)} image(s) were given; put one placeholder per "
                f"image, or each image's exact expansion ({[item.num_tokens for item in items]} tokens)")
        for offset, item in zip(offsets, items):
            item.offset = offset
        return token_ids

    @staticmethod
    def _expand_each(token_ids: list[int], starts: list[int], items: list[MMItem]) -> list[int]:
        """Replace the placeholder at each of `starts` by its image's tokens."""
        out: list[int] = []
        previous = 0
        for start, item in zip(starts, items):
            out.extend(token_ids[previous:start])
            item.offset = len(out)
            out.extend([token_ids[start]] * item.num_tokens)
            previous = start + 1
        out.extend(token_ids[previous:])
        return out


def _timed(fn, *args) -> ProcessedPrompt:
    arrival, t0 = time.time(), time.perf_counter()
    processed = fn(*args)
    processed.arrival_time = arrival
    processed.preprocess_s = time.perf_counter() - t0
    return processed


def _expanded_offsets(runs: list[tuple[int, int]], items: list[MMItem]) -> list[int] | None:
    """Where each image starts if every run is the expansion of one or more consecutive images (images whose
    placeholders were back to back form one run), else None."""
    offsets: list[int] = []
    for start, length in runs:
        while length > 0 and len(offsets) < len(items):
            need = items[len(offsets)].num_tokens
            if need > length:
                return None
            offsets.append(start)
            start, length = start + need, length - need
        if length:
            return None
    return offsets if len(offsets) == len(items) else None


def _runs_of(ids: list[int], tok: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `tok` in `ids`; list.index skips the text between runs in C."""
    runs, i, n = [], 0, len(ids)
    while True:
        try:
            i = ids.index(tok, i)
        except ValueError:
            return runs
        j = i + 1
        while j < n and ids[j] == tok:
            j += 1
        runs.append((i, j - i))
        i = j


def _image_source(part: dict, where: str) -> Any:
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise InvalidRequestError(f"{where}: image_url part needs image_url.url (a data URI or a file path)")
        if url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"{where}: http(s) image URLs are not fetched; send a data URI")
        return url
    src = part.get("image", part.get("image_url"))
    if src is None:
        raise InvalidRequestError(f"{where}: image part has no 'image'")
    return src
