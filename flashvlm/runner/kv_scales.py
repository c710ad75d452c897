"""Where an FP8 KV cache's per-layer K and V scales come from: the checkpoint, or a calibration at start-up.

Each decoder layer's `PagedAttention` owns its two scales (`k_scale`, `v_scale`: 1-element float32 buffers, NaN until
set). A checkpoint made with a compressed-tensors `kv_cache_scheme` (llm-compressor) carries them as
`...layers.N.self_attn.k_scale` / `v_scale`, and loading puts them there. Otherwise the runner calibrates before the
memory profile: one prefill of a seeded random prompt through the model, with the cache in the model's dtype,
records the largest |K| and |V| each layer writes, and the scale is that amax x KV_SCALE_MARGIN / 448. Writes
saturate at +-448, so a later value beyond the margin is clipped, never inf or NaN. docs/quantization.md ("KV cache")
explains the choice and its limits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from flashvlm.attention.base import AttentionBackend
from flashvlm.attention.kv_quant import FP8_E4M3_MAX
from flashvlm.config import ConfigError
from flashvlm.layers.attention import PagedAttention
from flashvlm.models.interfaces import VLModel
from flashvlm.runner.inputs import single_sequence_context

logger = logging.getLogger(__name__)

KV_SCALE_MARGIN = 4.0
"""Calibrated scales leave this much headroom over the largest |K| and |V| the calibration prompt produced. e4m3
keeps the same relative step (2^-4) over its whole normal range, so headroom costs precision only for values under
1/7168 of the calibrated maximum (which turn subnormal), while a value past the range would be clipped: and the
largest keys are the ones attention weighs most."""

CALIBRATION_TOKENS = 512
"""Length of the calibration prompt (capped by max_num_batched_tokens and max_model_len): long enough for each
layer to see its attention-sink first token, its bias-driven large channels and hundreds of ordinary tokens."""


_SUPPORTED_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
_SCHEME_DEFAULTS = {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False, "symmetric": True}
"""What compressed-tensors' QuantizationArgs takes for a field the scheme leaves out (or null)."""


def checkpoint_kv_scheme(hf_config: Any) -> dict | None:
    """The checkpoint's compressed-tensors `quantization_config.kv_cache_scheme`, or None when it has none. A scheme
    other than static per-tensor FP8 (what llm-compressor writes by default) is refused with a ConfigError naming
    the fields that differ."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None and not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    scheme = (quant or {}).get("kv_cache_scheme")
    if scheme is None:
        return None
    if not isinstance(scheme, dict):
        raise ConfigError(f"the checkpoint's quantization_config.kv_cache_scheme must be a mapping, got {scheme!r}")
    actual = {key: default if scheme.get(key) is None else scheme[key] for key, default in _SCHEME_DEFAULTS.items()}
    differ = {key: value for key, value in actual.items() if value != _SUPPORTED_SCHEME[key]}
    if differ:
        shown = ", ".join(f"{key}={value!r}" for key, value in differ.items())
        raise ConfigError(f"the checkpoint's kv_cache_scheme ({shown}) is not one flashvlm runs: it reads static "
                          f"per-tensor FP8 K/V scales (num_bits 8, type float, strategy tensor, dynamic false, "
                          f"symmetric)")
    return scheme


def attention_layers(model: VLModel) -> list[PagedAttention]:
    """The decoder's attention layers in layer order, one per KV cache layer."""
    layers = sorted((m for m in model.modules() if isinstance(m, PagedAttention)), key=lambda m: m.layer_idx)
    expected = model.kv_cache_spec().num_layers
    if [m.layer_idx for m in layers] != list(range(expected)):
        raise RuntimeError(f"expected attention layers 0..{expected - 1}, found {[m.layer_idx for m in layers]}")
    return layers


def resolve_kv_scales(model: VLModel, scheme: dict | None, calibrate: Callable[[], torch.Tensor]) -> str:
    """Make every layer's scales valid and say where they came from ("checkpoint" or "calibrated"). Scales loaded
    for every layer are used as they are; a checkpoint whose kv_cache_scheme promises scales it does not hold for
    every layer, or that holds them for some layers only, is a ConfigError; with none, `calibrate()` gives the
    (num_layers, 2) amax of K and V per layer."""
    layers = attention_layers(model)
    loaded = [torch.isfinite(m.k_scale).all().item() and torch.isfinite(m.v_scale).all().item() for m in layers]
    if all(loaded):
        for m in layers:
            if (m.k_scale <= 0).any() or (m.v_scale <= 0).any():
                raise ConfigError(f"layer {m.layer_idx}'s checkpoint KV scales must be positive, got k_scale "
                                  f"{m.k_scale.item()}, v_scale {m.v_scale.item()}")
        return "checkpoint"
    if scheme is not None or any(loaded):
        missing = [m.layer_idx for m, ok in zip(layers, loaded) if not ok]
        raise ConfigError(f"the checkpoint lacks self_attn.k_scale / v_scale for layer(s) {missing}"
                          + (" although its kv_cache_scheme declares them" if scheme is not None else ""))
    amax = calibrate()
    if not torch.isfinite(amax).all():
        raise RuntimeError(f"the KV scale calibration saw non-finite keys or values (amax by layer: {amax.tolist()})")
    if (amax == 0).any():
        zero_layers = (amax == 0).any(1).nonzero().flatten().tolist()
        logger.warning("KV scale calibration: layers %s wrote only zero keys or values", zero_layers)
    scales = amax.clamp(min=torch.finfo(torch.float32).tiny) * KV_SCALE_MARGIN / FP8_E4M3_MAX
    with torch.no_grad():
        for m, (k_scale, v_scale) in zip(layers, scales.to(layers[0].k_scale.device)):
            m.k_scale.fill_(k_scale)
            m.v_scale.fill_(v_scale)
    logger.info("FP8 KV cache: scales calibrated from |K| up to %.3g and |V| up to %.3g (x%.1f headroom)",
                amax[:, 0].max().item(), amax[:, 1].max().item(), KV_SCALE_MARGIN)
    return "calibrated"


@torch.inference_mode()
def calibration_amax(model: VLModel, backend: AttentionBackend, dtype: torch.dtype, device: torch.device,
                     block_size: int, num_tokens: int, seed: int) -> torch.Tensor:
    """(num_layers, 2) float32: the largest |K| and |V| each layer writes while prefilling `num_tokens` seeded random
    tokens into a throwaway cache of the model's dtype (so no layer sees another's quantization error)."""
    spec = model.kv_cache_spec()
    ctx = single_sequence_context(num_tokens, spec, dtype, device, block_size, backend)
    ctx.kv_amax = torch.zeros(spec.num_layers, 2, dtype=torch.float32, device=device)
    generator = torch.Generator().manual_seed(seed)
    token_ids = torch.randint(0, model.vocab_size, (num_tokens,), generator=generator).to(device)
    positions = torch.arange(num_tokens, device=device)
    if model.uses_mrope:
        positions = positions.expand(3, num_tokens)
    model(model.embed_tokens(token_ids), positions, ctx)
    amax = ctx.kv_amax.cpu()
    del ctx
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return amax
