"""What the engine derives at start-up from the validated config, the checkpoint and the device. These values are
never written back into the config: the config says what was asked for, `EngineLimits` what the engine runs with."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    """Longest prompt + output of one request, in tokens: the config's max_model_len, or the checkpoint's
    max_position_embeddings when that is None. Derived by the Engine (`resolve_max_model_len`) once the
    checkpoint's config is read; the scheduler, the runner (graph shapes, the decode split bound) and the server
    (context-length errors, /v1/models) read it."""
    num_kv_blocks: int
    """KV cache blocks allocated, block 0 (the null block) included. Derived by the runner's memory planner
    (`MemoryPlanner.determine_num_blocks`): from kv_cache_tokens when given, else on CUDA from what
    gpu_memory_utilization leaves after the memory profile, else (CPU) from max_model_len and max_num_seqs."""
    lookahead_slots: int
    """KV slots a decoding request holds past its next token: 1 when the runner built the greedy decode pipeline
    (decode_lookahead with CUDA graphs), else 0. Derived by the Engine from the runner once the KV cache and graphs
    are set up. The scheduler then gives a decoding request the block of its next token too when one is free, so
    the step launched ahead never waits on an allocation. Such a block is taken only from a surplus (a free block
    left for every running request), so no running request's own token preempts anyone for it; a new request
    admitted in the same step may find fewer free blocks and preempt a lower-priority one."""
    attention_backend: str = "reference"
    """The language model's attention backend that runs: the validated config's choice, moved off FA4 for a model
    dtype FA4 does not take (`EngineConfig.attention_for_dtype`)."""
    vision_attention: str = "sdpa"
    """The vision towers' attention backend that runs, chosen the same way."""
    quantization: dict[str, Any] | None = None
    """What the weights run quantized with (`quant.apply.quantization_summary`): method, scheme, where it came
    from (the checkpoint or --quantization), layer counts per format. None: every layer in the model dtype."""
    kv_cache_dtype: str = "float32"
    """The KV cache's dtype as allocated ("bfloat16", "float32", ... for kv_cache_dtype auto: the model's;
    "float8_e4m3fn" for fp8). Derived by the runner (`ModelRunner.kv_dtype`)."""
    kv_scale_source: str = "none"
    """Where an FP8 cache's per-layer K and V scales came from: "checkpoint" (its kv_cache_scheme's k_scale /
    v_scale tensors) or "calibrated" (at start-up, runner/kv_scales.py); "none" for a cache in the model's dtype."""


def resolve_max_model_len(requested: int | None, model_limit: int) -> int:
    """The config's max_model_len (None: the checkpoint's max_position_embeddings), warning when it exceeds what
    the model was trained for."""
    if requested is None:
        return model_limit
    if requested > model_limit:
        logger.warning("max_model_len %d exceeds the model's max_position_embeddings %d", requested, model_limit)
    return requested
