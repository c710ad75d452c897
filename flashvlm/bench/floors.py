"""Hardware floors: the least time a step can take given the bytes it must read and the FLOPs it must do.

Counts come from the built model's own parameters (so every family is covered) plus its attention
shape. Decode is bandwidth-bound: every step reads all language-model weights once plus each
sequence's KV cache. Prefill is compute-bound: 2 FLOPs per weight per token, plus attention.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

# Measured on one H200 (shared/reference: device-to-device copy, 8192^3 bf16 GEMM).
H200_BANDWIDTH = 4.2e12
H200_BF16_FLOPS = 790e12


@dataclass(frozen=True)
class ModelCost:
    lm_weight_bytes: int
    """Bytes of the language model's matrices read by one decode step (embedding excluded, lm_head included)."""
    lm_matmul_params: int
    """Parameters used in matrix products per token (lm_head excluded: only sampled rows use it)."""
    lm_head_params: int
    num_layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int
    vit_matmul_params: int
    vit_depth: int
    vit_width: int


def _matrices(module: nn.Module | None) -> list[tuple[str, nn.Parameter]]:
    if module is None:
        return []
    return [(n, p) for n, p in module.named_parameters() if p.dim() >= 2]


def model_cost(model: nn.Module) -> ModelCost:
    """Works on flashvlm VLModel instances (language_model + visual / vision_tower + projector)."""
    lm = model.language_model
    spec = model.kv_cache_spec()
    attn = lm.layers[0].self_attn
    lm_mats = [(n, p) for n, p in _matrices(lm) if "embed_tokens" not in n]
    head = getattr(model, "lm_head", None)
    head_params = head.weight.numel() if head is not None else lm.embed_tokens.weight.numel()
    elem = next(lm.parameters()).element_size()
    vision = getattr(model, "visual", None) or getattr(model, "vision_tower", None)
    vit_params = sum(p.numel() for _, p in _matrices(vision))
    vit_params += sum(p.numel() for _, p in _matrices(getattr(model, "multi_modal_projector", None)))
    vc = model.config.vision_config
    depth = int(getattr(vc, "depth", None) or getattr(vc, "num_hidden_layers", 0))
    # Qwen2-VL names the ViT width embed_dim (its hidden_size is the merger's output); others hidden_size.
    width = int(getattr(vc, "embed_dim", None) or vc.hidden_size)
    return ModelCost(
        lm_weight_bytes=(sum(p.numel() for _, p in lm_mats) + head_params) * elem,
        lm_matmul_params=sum(p.numel() for _, p in lm_mats), lm_head_params=head_params,
        num_layers=spec.num_layers, num_heads=attn.num_heads, head_dim=spec.head_dim,
        kv_bytes_per_token=2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem,
        vit_matmul_params=vit_params, vit_depth=depth, vit_width=width)


def prefill_flops(cost: ModelCost, num_tokens: int, context: int = 0, num_sampled: int = 1) -> float:
    """FLOPs of prefilling num_tokens after `context` cached tokens (causal attention)."""
    linear = 2.0 * num_tokens * cost.lm_matmul_params + 2.0 * num_sampled * cost.lm_head_params
    # QK^T and PV: 2 matmuls x 2 FLOPs x heads x head_dim x (keys seen by each query).
    keys_seen = num_tokens * context + num_tokens * (num_tokens + 1) / 2
    attention = 4.0 * cost.num_layers * cost.num_heads * cost.head_dim * keys_seen
    return linear + attention


def vision_flops(cost: ModelCost, num_patches: int) -> float:
    """ViT FLOPs for one image of num_patches patches (full attention: an upper bound for windowed)."""
    return 2.0 * num_patches * cost.vit_matmul_params + 4.0 * cost.vit_depth * cost.vit_width * num_patches ** 2


def decode_step_bytes(cost: ModelCost, context_lens: list[int]) -> float:
    return cost.lm_weight_bytes + cost.kv_bytes_per_token * sum(context_lens)


@dataclass
class Floors:
    decode_floor_ms_per_token: float
    """Batch-1 decode step at the workload's mean context: weights + KV over bandwidth."""
    prefill_floor_ms: float
    """TTFT floor of the workload's mean request: vision + prefill FLOPs over peak."""
    bandwidth: float
    peak_flops: float


def workload_floors(cost: ModelCost, prompt_tokens: float, output_tokens: float, patches_per_request: float,
                    bandwidth: float = H200_BANDWIDTH, peak_flops: float = H200_BF16_FLOPS) -> Floors:
    mean_context = prompt_tokens + output_tokens / 2
    decode = decode_step_bytes(cost, [int(mean_context)]) / bandwidth
    prefill = (prefill_flops(cost, int(prompt_tokens)) + vision_flops(cost, int(patches_per_request))) / peak_flops
    return Floors(decode_floor_ms_per_token=decode * 1e3, prefill_floor_ms=prefill * 1e3, bandwidth=bandwidth,
                  peak_flops=peak_flops)


def achieved(summary: dict[str, Any], floors: Floors) -> dict[str, float | None]:
    """Fraction of the floor reached (floor / measured): 1.0 would be running at the hardware limit."""
    tpot = (summary.get("tpot_ms") or {}).get("p50")
    ttft = (summary.get("ttft_ms") or {}).get("p50")
    return {
        **asdict(floors),
        "achieved_decode_fraction": floors.decode_floor_ms_per_token / tpot if tpot else None,
        "achieved_prefill_fraction": floors.prefill_floor_ms / ttft if ttft else None,
    }
