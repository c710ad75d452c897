"""A prompt's video placeholders expanded into its frames' tokens (each two-frame temporal patch one MMItem,
decoded and sampled by the family's video part, processing/qwen_video.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flashvlm.request import InvalidRequestError, MMItem


def attach_videos(video_inputs: Any, tokenizer: Any, token_ids: list[int], videos: Sequence[Any],
              video_kwargs: dict, items: list[MMItem]) -> list[int]:
    """Expand each video placeholder token into its frames' tokens (`QwenVideoInputs.make_items`), shifting the
    image items after it, and add the frame items to `items`. Video tokens are never pruned."""
    tok = video_inputs.video_token_id
    starts = [i for i, t in enumerate(token_ids) if t == tok]
    if len(starts) != len(videos):
        raise InvalidRequestError(f"prompt has {len(starts)} video placeholder token(s) but {len(videos)} "
                                  "video(s) were given; put one placeholder per video")
    out: list[int] = []
    previous, frames = 0, []
    image_offsets = [item.offset for item in items]
    for index, (start, src) in enumerate(zip(starts, videos)):
        try:
            video_items, ids = video_inputs.make_items(src, video_kwargs, tokenizer)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"video {index}: {e}") from None
        out.extend(token_ids[previous:start])
        for item, original in zip(items, image_offsets):  # images after this placeholder move by its expansion
            if original > start:
                item.offset += len(ids) - 1
        for item in video_items:
            item.offset += len(out)
        out.extend(ids)
        frames += video_items
        previous = start + 1
    out.extend(token_ids[previous:])
    items += frames
    return out
