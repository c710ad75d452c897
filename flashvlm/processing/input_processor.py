"""From a user prompt (text or token ids, plus images) to a `Request`: decode and preprocess images,
hash them, tokenize, and expand each image placeholder to as many tokens as the image yields. Preprocessed pixels
of recent images are kept in a PixelCache (pixel_cache.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flashvlm.models.loader import Checkpoint
from flashvlm.processing.images import load_image, rgb_array
from flashvlm.processing.messages import check_unicode, normalize_messages
from flashvlm.processing.pixel_cache import PixelCache
from flashvlm.processing.preprocess import SourceImage
from flashvlm.processing.qwen_video import VIDEO_KWARGS
from flashvlm.processing.tool_prompt import check_tools, with_tools
from flashvlm.processing.video_prompt import attach_videos
from flashvlm.pruning.base import PruningSettingError
from flashvlm.pruning.setting import (
    NO_GRID_EXAMPLES,
    PRUNING_KWARGS,
    PruningChoice,
    pruning_for,
    resolve_setting,
    strategy_of,
)
from flashvlm.request import InvalidRequestError, MMItem

NO_PRUNING = PruningChoice()


@dataclass
class ProcessedPrompt:
    prompt_token_ids: list[int]
    mm_items: list[MMItem]
    arrival_time: float = field(default_factory=time.time)
    """When processing began: the request's arrival as the user sees it."""
    preprocess_s: float = 0.0
    """Seconds from when processing began until the prompt was ready: decoding and preprocessing images,
    templating, tokenizing (on the server's pools, also the waits for their workers)."""


@dataclass
class PromptText:
    """A prompt's text part, checked, before any image is decoded: its token ids (placeholders not yet expanded),
    its image sources in order, and the request's processor settings."""

    token_ids: list[int]
    images: list[Any]
    family_kwargs: dict
    """mm_processor_kwargs the model family's image processor reads."""
    pruning: PruningChoice
    videos: list[Any] = field(default_factory=list)
    """The prompt's video sources in order (decoded when the prompt is assembled)."""
    video_kwargs: dict = field(default_factory=dict)
    """mm_processor_kwargs the family's video sampling reads (fps, frames, pixel limits)."""


class InputProcessor:
    """Owns the tokenizer, chat template and image processor of one model."""

    def __init__(self, checkpoint: Checkpoint, vocab_size: int, image_token_id: int,
                 max_images_per_prompt: int = 16, pixel_cache_bytes: int = 256 << 20,
                 preprocess_device: str | None = None, pruning: PruningChoice = NO_PRUNING,
                 resize_on_device: bool = False) -> None:
        self.checkpoint = checkpoint
        self.tokenizer = checkpoint.tokenizer
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.max_images_per_prompt = max_images_per_prompt
        self.image_inputs = checkpoint.family.image_inputs(checkpoint)
        """The model family's image part: one picture to one MMItem."""
        if resize_on_device and hasattr(self.image_inputs, "resize_where_decoded"):
            # The engine finishes compact pixels on a GPU: the family may leave its resize to it as well.
            self.image_inputs = replace(self.image_inputs, resize_where_decoded=True)
        self.image_processor = self.image_inputs.processor
        self.video_inputs = checkpoint.family.video_inputs(checkpoint)
        """The family's video part (processing/qwen_video.py), None for a model without video input."""
        self.pixel_cache = PixelCache(pixel_cache_bytes)
        """Preprocessed pixels of recent images; pixel_cache_bytes=0 turns it off."""
        self._image_token = self.tokenizer.convert_ids_to_tokens(image_token_id)
        self.preprocess_device = preprocess_device
        """Where rescale/normalize/patchify run (None: CPU); decoding and resizing always run on the CPU."""
        self.pruning = pruning
        """The engine's mm_token_pruning options; a request's mm_processor_kwargs override them."""
        if pruning.strategy != "none" and self.image_inputs.token_grid(self.image_inputs.profile_item()) is None:
            from flashvlm.config import ConfigError

            raise ConfigError(f"mm_token_pruning {pruning.strategy!r}: this model's image tokens form no grid "
                              f"({NO_GRID_EXAMPLES}); use 'none'")
        if pruning.strategy == "dedup" and not hasattr(self.image_inputs, "token_pixels"):
            from flashvlm.config import ConfigError

            raise ConfigError("mm_token_pruning 'dedup': this model's images give no per-token pixels; use pool or "
                              "divprune")

    # ---- prompts -------------------------------------------------------------------------------
    def process(self, prompt: str | dict[str, Any], mm_processor_kwargs: dict | None = None) -> ProcessedPrompt:
        return _timed(self._process, prompt, mm_processor_kwargs)

    def process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None = None,
                     chat_template: str | None = None, add_generation_prompt: bool = True,
                     tools: list[dict] | None = None) -> ProcessedPrompt:
        """OpenAI-style messages: content is a string or a list of parts (text, image_url, image); assistant
        `tool_calls` and `tool` messages in the history, and the `tools` the model may call (processing.tool_prompt
        says how they reach the template)."""
        return _timed(self._process_chat, messages, mm_processor_kwargs, chat_template, add_generation_prompt,
                      tools)

    def _process(self, prompt: str | dict[str, Any], mm_processor_kwargs: dict | None) -> ProcessedPrompt:
        text = self.prompt_text(prompt, mm_processor_kwargs)
        return self.assemble(text, [self.image_item(src, text, i) for i, src in enumerate(text.images)])

    def _process_chat(self, messages: list[dict], mm_processor_kwargs: dict | None, chat_template: str | None,
                      add_generation_prompt: bool, tools: list[dict] | None) -> ProcessedPrompt:
        text = self.chat_text(messages, mm_processor_kwargs, chat_template, add_generation_prompt, tools)
        return self.assemble(text, [self.image_item(src, text, i) for i, src in enumerate(text.images)])

    # ---- the three stages: text, each image, assembly (prompt_pipeline.py runs them on separate pools) ---
    def prompt_text(self, prompt: str | dict[str, Any], mm_processor_kwargs: dict | None = None) -> PromptText:
        """A `generate` prompt (text or token ids, optional images), tokenized and checked."""
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        if not isinstance(prompt, dict):
            raise InvalidRequestError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "images", "image", "videos", "video",
                                 "mm_processor_kwargs"}
        if unknown:
            raise InvalidRequestError(f"unknown prompt field(s): {sorted(unknown)}")
        images = prompt.get("images", prompt.get("image", []))
        if not isinstance(images, (list, tuple)):
            images = [images]
        videos = prompt.get("videos", [prompt["video"]] if "video" in prompt else [])
        if not isinstance(videos, (list, tuple)):
            videos = [videos]
        kwargs = {**(mm_processor_kwargs or {}), **(prompt.get("mm_processor_kwargs") or {})}
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, Sequence) or isinstance(ids, str) or not all(isinstance(i, int) for i in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of integers")
            token_ids = list(ids)
        elif "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise InvalidRequestError("prompt must be a string")
            check_unicode(prompt["prompt"], "prompt")
            token_ids = self._encode_text(prompt["prompt"], len(images))
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        return self._checked(token_ids, list(images), kwargs, list(videos))

    def _check_image_count(self, n: int) -> None:
        if n > self.max_images_per_prompt:
            raise InvalidRequestError(f"{n} images in one prompt; the limit is {self.max_images_per_prompt}")
        family_limit = getattr(self.image_inputs, "max_images_per_prompt", None)
        if family_limit is not None and n > family_limit:
            raise InvalidRequestError(f"{n} images in one prompt; this model takes at most {family_limit} "
                                      "(as its Hugging Face processor does)")

    def _encode_text(self, text: str, num_images: int) -> list[int]:
        """A raw prompt's token ids: the tokenizer's, with its special tokens, unless the family's image part
        builds them its own way (`encode_prompt`: Fuyu's processor puts the image before the BOS)."""
        encode = getattr(self.image_inputs, "encode_prompt", None)
        if encode is None:
            return self.tokenizer.encode(text, add_special_tokens=True)
        self._check_image_count(num_images)  # before the family's prompt rules read the text
        return encode(self.tokenizer, text, num_images)

    def chat_text(self, messages: list[dict], mm_processor_kwargs: dict | None = None,
                  chat_template: str | None = None, add_generation_prompt: bool = True,
                  tools: list[dict] | None = None) -> PromptText:
        """OpenAI-style messages (and the tools the model may call) through the chat template, tokenized and
        checked."""
        template = chat_template or self.checkpoint.chat_template
        if template is None:
            raise InvalidRequestError("this model has no chat template; use generate() with a raw prompt")
        templated, images, videos = normalize_messages(messages)
        templated, template_tools = with_tools(templated, None if tools is None else check_tools(tools), template)
        text = self.tokenizer.apply_chat_template(templated, chat_template=template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  **({"tools": template_tools} if template_tools else {}))
        check_unicode(text, "the templated chat")  # a role or template text the message checks did not see
        token_ids = self.tokenizer.encode(text, add_special_tokens=self._adds_special_tokens(text))
        return self._checked(token_ids, images, mm_processor_kwargs or {}, videos)

    def image_item(self, src: Any, text: PromptText, index: int) -> MMItem:
        """Decode, hash, preprocess and prune image `index` of a prompt: all of one image's heavy work, and
        nothing that reads the other images. Thread-safe."""
        try:
            array = rgb_array(src)  # an RGB numpy array stays one while it needs no resize: no PIL round trip
            image = SourceImage(pil=load_image(src)) if array is None else SourceImage(array=array)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"image {index}: {e}") from None
        item = self.image_inputs.make_item(image, text.family_kwargs, self.pixel_cache, self.preprocess_device)
        self._prune(item, text.pruning)
        return item

    def assemble(self, text: PromptText, items: list[MMItem]) -> ProcessedPrompt:
        """The prompt with each image's placeholders expanded to its (kept) token count (a walk over the ids), and
        each video's placeholder to its frames' tokens (its frames decoded here: prompt_pipeline.py runs a prompt
        with videos on the image pool)."""
        token_ids = self._expand_placeholders(text.token_ids, items)
        if text.videos or (self.video_inputs is not None and self.video_inputs.video_token_id in token_ids):
            items = list(items)
            if self.video_inputs is None:
                raise InvalidRequestError("this model takes no video input")
            token_ids = attach_videos(self.video_inputs, self.tokenizer, token_ids, text.videos, text.video_kwargs,
                                      items)
            items.sort(key=lambda it: it.offset)
        return ProcessedPrompt(token_ids, items)

    def _adds_special_tokens(self, templated: str) -> bool:
        """Whether the tokenizer adds its special tokens (a BOS) to a templated chat: as transformers' processors
        do, unless the template already starts with the BOS. llava-hf templates do not write one, and their models
        were trained with it."""
        bos = self.tokenizer.bos_token
        return not (bos is not None and templated.startswith(bos))

    # ---- images --------------------------------------------------------------------------------
    def _checked(self, token_ids: list[int], images: list[Any], kwargs: dict,
                 videos: Sequence[Any] = ()) -> PromptText:
        self._check_image_count(len(images))
        if videos:  # before any image is decoded
            if self.video_inputs is None:
                raise InvalidRequestError("this model takes no video input")
            if len(videos) > self.max_images_per_prompt:
                raise InvalidRequestError(f"{len(videos)} videos in one prompt; the limit is "
                                          f"{self.max_images_per_prompt} (the images-per-prompt limit)")
            if self.pruning.strategy != "none" or any(k in kwargs for k in PRUNING_KWARGS):
                raise InvalidRequestError("image token pruning (mm_token_pruning) does not apply to videos; "
                                          "use mm_processor_kwargs video_pruning")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        setting = self._pruning_setting(kwargs)  # checked with or without images
        family_kwargs = {k: v for k, v in kwargs.items() if k not in PRUNING_KWARGS and k not in VIDEO_KWARGS}
        video_kwargs = {k: v for k, v in kwargs.items() if k in VIDEO_KWARGS}
        return PromptText(token_ids, images, family_kwargs, setting, list(videos), video_kwargs)

    def _pruning_setting(self, kwargs: dict) -> PruningChoice:
        try:
            return resolve_setting(self.pruning, kwargs)
        except PruningSettingError as e:
            raise InvalidRequestError(str(e)) from None

    def _prune(self, item: MMItem, setting: PruningChoice) -> None:
        """Give the item its pruning setting and expand its placeholders to the kept count (the tower still
        yields `item.encoder_tokens`). dedup decides its kept tokens here, from the item's pixels."""
        token_pixels = getattr(self.image_inputs, "token_pixels", None)
        try:
            item.pruning = pruning_for(setting, self.image_inputs.token_grid(item), item.num_tokens,
                                       None if token_pixels is None else lambda: token_pixels(item))
        except PruningSettingError as e:
            raise InvalidRequestError(str(e)) from None
        if item.pruning is not None:
            item.num_tokens = item.pruning.num_kept

    def profile_items(self, budget_tokens: int) -> list[MMItem]:
        """Stand-ins for the heaviest vision batch one step can hold, for memory profiling: the largest image
        a request may send, repeated as often as the step's token budget covers (once for an image that outweighs
        the budget). Pixel values are zeros: only shapes matter. With the engine's pruning on, a step's token budget
        holds the placeholders of more images: as many as its fewest kept tokens cover (dedup: one a tile)."""
        item = self.image_inputs.profile_item()
        per_image = item.num_tokens
        if self.pruning.strategy != "none":
            grid = self.image_inputs.token_grid(item)
            per_image = strategy_of(self.pruning).fewest_kept(grid, self.pruning.keep_ratio)
        return [item] * max(1, budget_tokens // per_image)

    def _expand_placeholders(self, token_ids: list[int], items: list[MMItem]) -> list[int]:
        """Each placeholder token stands for one image and is expanded, as HF's processors do, even when
        placeholders sit back to back. A prompt already expanded (runs made of whole images' token counts, in
        order) is accepted as it is."""
        tok = self.image_token_id
        runs = _runs_of(token_ids, tok)
        count = sum(length for _, length in runs)
        expand = getattr(self.image_inputs, "placeholder_ids", None)
        # A family's own expansion (Fuyu's rows end in a newline) is recognised by its ids, tried first: a 1x1
        # Fuyu grid expands to one placeholder and a newline, so the count alone cannot tell.
        offsets = None if expand is None else _matched_offsets(token_ids, tok, [expand(it, tok) for it in items])
        if offsets is None and count == len(items):
            starts = [i for start, length in runs for i in range(start, start + length)]
            return self._expand_each(token_ids, starts, items)
        if expand is None:
            offsets = _expanded_offsets(runs, items)
        if offsets is None:
            raise InvalidRequestError(
                f"prompt has {count} image placeholder token(s) {self._image_token!r} (in runs of "
                f"{[length for _, length in runs]}) but {len(items)} image(s) were given; put one placeholder per "
                f"image, or each image's exact expansion ({[item.num_tokens for item in items]} tokens)")
        for offset, item in zip(offsets, items):
            item.offset = offset
        return token_ids

    def _expand_each(self, token_ids: list[int], starts: list[int], items: list[MMItem]) -> list[int]:
        """Replace the placeholder at each of `starts` by its image's tokens: num_tokens copies of it, or the ids the
        family's image part gives (`placeholder_ids`: Fuyu ends each row of patches in a newline token)."""
        expand = getattr(self.image_inputs, "placeholder_ids", None)
        out: list[int] = []
        previous = 0
        for start, item in zip(starts, items):
            out.extend(token_ids[previous:start])
            item.offset = len(out)
            out.extend([token_ids[start]] * item.num_tokens if expand is None else expand(item, token_ids[start]))
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


def _matched_offsets(ids: list[int], tok: int, expansions: list[list[int]]) -> list[int] | None:
    """Where each image starts if the prompt holds exactly these expansions, in order, each at a placeholder token
    and no placeholder token outside them; else None."""
    offsets, cursor = [], 0
    for expansion in expansions:
        try:
            start = ids.index(tok, cursor)
        except ValueError:
            return None
        if ids[start:start + len(expansion)] != expansion:
            return None
        offsets.append(start)
        cursor = start + len(expansion)
    return offsets if tok not in ids[cursor:] else None


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
