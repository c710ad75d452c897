"""The model half of building an engine: read the checkpoint, settle its dtype, KV scheme and quantization, load
and shard the model, and set its kernels and attention. The engine builds its caches, scheduler and runner on
what this returns."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from flashvlm.attention.vision import set_vision_attention
from flashvlm.config import EngineConfig
from flashvlm.distributed.encoder import split_encoder
from flashvlm.distributed.prequant_shard import check_vision_float
from flashvlm.distributed.quant_shard import quantize_sharded
from flashvlm.distributed.shard import shard_model
from flashvlm.distributed.sharded_load import check_prequantized_split, loads_sharded
from flashvlm.distributed.workers import TensorParallel
from flashvlm.engine.limits import resolve_max_model_len
from flashvlm.kernels.dispatch import set_kernel_backend
from flashvlm.layers.linear import GEMV_MAX_ROWS, set_gemv_max_rows
from flashvlm.models.interfaces import VLModel
from flashvlm.models.loader import Checkpoint, load_model, read_checkpoint, resolve_dtype
from flashvlm.quant.plan import QuantPlan, resolve_plan
from flashvlm.runner.kv_scales import checkpoint_kv_scheme

# The engine's logger: the attention choice is a line of the engine's startup log.
logger = logging.getLogger("flashvlm.engine.engine")


@dataclass(frozen=True)
class LoadedModel:
    """What setup_model built, for the engine to keep."""

    checkpoint: Checkpoint
    model: VLModel
    dtype: torch.dtype
    quant_plan: QuantPlan | None
    """None: the model runs unquantized."""
    kv_scheme: dict | None
    """The checkpoint's validated kv_cache_scheme (runner.kv_scales), for an FP8 cache; None when it has none or
    the cache is in the model dtype."""
    max_len: int
    """Longest prompt + output of one request (EngineLimits.max_model_len)."""
    attention_backend: str
    vision_attention: str
    load_time: float
    """Seconds from reading the checkpoint until the model was ready."""


def setup_model(config: EngineConfig, tp: TensorParallel) -> LoadedModel:
    """Load this rank's part of the model, ready to run: sharded, quantized, with its kernels and attention set.
    The caller seeds torch first (random weights and calibration read the seed)."""
    mc = config.model
    t0 = time.perf_counter()
    checkpoint = read_checkpoint(mc)
    # An FP8 cache reads the checkpoint's KV scales: a scheme we cannot run is refused before loading. A cache in
    # the model dtype ignores them, so such a checkpoint still loads.
    kv_scheme = checkpoint_kv_scheme(checkpoint.hf_config) if config.cache.kv_cache_dtype != "auto" else None
    max_len = resolve_max_model_len(mc.max_model_len, checkpoint.max_position_embeddings)
    dtype = resolve_dtype(mc, checkpoint.hf_config, config.device)
    quant_plan = resolve_plan(mc.quantization, checkpoint.hf_config, mc.quantize_vision)
    prequantized = quant_plan is not None and quant_plan.prequantized
    sharded = tp.group.size > 1
    if prequantized and sharded:
        check_prequantized_split(checkpoint.hf_config, tp.group, mc.load_format)
    model = load_model(mc, checkpoint, config.device, dtype, quant_plan, tp.group)
    if prequantized and sharded and config.mm_encoder_tp_mode == "weights":
        check_vision_float(model)
    shard_model(model, tp.group, loads_sharded(checkpoint.hf_config, tp.group))
    split_encoder(model, tp.group, config.mm_encoder_tp_mode, dtype, torch.device(config.device))
    if quant_plan is not None and not prequantized and sharded:
        quantize_sharded(model, quant_plan, tp.group)
    set_kernel_backend(model, config.kernel_backend)
    attention_backend, vision_attention = config.attention_for_dtype(dtype)
    if (attention_backend, vision_attention) != (config.attention_backend, config.vision_attention):
        logger.info("attention %s / vision %s: FlashAttention-4 takes bf16/fp16 models and KV caches; the model "
                    "runs in %s, kv_cache_dtype is %s", attention_backend, vision_attention, dtype,
                    config.cache.kv_cache_dtype)
    set_vision_attention(model, vision_attention)
    set_gemv_max_rows(model, GEMV_MAX_ROWS if config.decode_gemv else 0)
    return LoadedModel(checkpoint=checkpoint, model=model, dtype=dtype, quant_plan=quant_plan, kv_scheme=kv_scheme,
                       max_len=max_len, attention_backend=attention_backend, vision_attention=vision_attention,
                       load_time=time.perf_counter() - t0)
