"""Engine outputs as the API's fields, for chat and completions alike: the finish reason a client reads, the usage
block, and one server-sent event."""

from __future__ import annotations

import json
from typing import Any

from flashvlm.engine.scheduler import KV_CAPACITY_STOP_REASON
from flashvlm.request import CompletionOutput, RequestOutput
from flashvlm.server.responses import UsageInfo, usage


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finish_reason(out: CompletionOutput) -> str:
    # The scheduler ends a request that outgrew the whole KV cache; to the client that is a length limit.
    if out.finish_reason == "abort" and out.stop_reason == KV_CAPACITY_STOP_REASON:
        return "length"
    return out.finish_reason or "stop"


def response_usage(out: RequestOutput) -> UsageInfo:
    # The prompt counts once, however many completions share it; completion tokens are summed over them.
    return usage(len(out.prompt_token_ids), out.num_output_tokens, getattr(out, "num_cached_tokens", 0) or 0,
                 getattr(out, "num_image_tokens", 0), getattr(out, "num_image_tokens_kept", 0))
