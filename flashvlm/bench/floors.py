"""Hardware floors: the least time work can take given the bytes it must read and the FLOPs it must do.

Counts come from the built model's own parameters (so every family is covered) plus its attention
shape. Decode is bandwidth-bound: every step reads all language-model weights once plus each
sequence's KV cache. Prefill is compute-bound: 2 FLOPs per weight per token, plus attention.

Two kinds: per-request floors (`workload_floors`: one request's TTFT and batch-1 decode, for the latency
scenarios) and the floor of a whole offline run (`run_floor`: every request's FLOPs and every decode step's
bytes, for throughput runs, where a batch shares each weight read).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from flashvlm.layers.linear import Linear, PlainLinear
from flashvlm.quant.base import QuantizedLinear

# Measured on one H200 (shared/reference: device-to-device copy, 8192^3 bf16 GEMM).
H200_BANDWIDTH = 4.2e12
H200_BF16_FLOPS = 790e12


@dataclass(frozen=True)
class ModelCost:
    lm_weight_bytes: int
    """Bytes of the language model's linear layers read by one decode step, as stored (quantized weights with
    their scales; biases included; embedding excluded, lm_head included)."""
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
    vit_full_layers: int = -1
    """ViT layers attending over the whole image; the others attend within windows. -1: all of them."""
    vit_window_patches: int = 0
    """Patches of one attention window in the windowed layers (Qwen2.5-VL: (112 / 14)^2 = 64); 0: none."""


def _linear_layers(module: nn.Module | None) -> list[nn.Module]:
    """Every linear layer under `module`: the layers/ classes (float) and the quantized layers replacing them
    (in_features/out_features and their own tensors, in whatever storage dtype)."""
    if module is None:
        return []
    return [m for m in module.modules() if isinstance(m, (Linear, PlainLinear, QuantizedLinear))]


def _matmul_params(layers: list[nn.Module]) -> int:
    """Weights used in products: in x out per layer (a 4-bit layer's packed words hold 8 of them)."""
    return sum(m.in_features * m.out_features for m in layers)


def _stored_bytes(layers: list[nn.Module]) -> int:
    """Bytes a product reads: every tensor of each layer (weights, scales, zero points, bias) as stored."""
    return sum(p.numel() * p.element_size() for m in layers for p in m.parameters(recurse=False))


def model_cost(model: nn.Module, kv_element_size: int | None = None) -> ModelCost:
    """Works on flashvlm VLModel instances (language_model + visual / vision_tower + projector), with float or
    quantized linear layers. kv_element_size: bytes per KV cache element (None: the model dtype's)."""
    lm = model.language_model
    spec = model.kv_cache_spec()
    attn = lm.layers[0].self_attn
    lm_layers = _linear_layers(lm)
    head = getattr(model, "lm_head", None)
    head_params = head.weight.numel() if head is not None else lm.embed_tokens.weight.numel()
    head_bytes = _stored_bytes([head]) if head is not None else lm.embed_tokens.weight.numel() * \
        lm.embed_tokens.weight.element_size()
    kv_elem = kv_element_size or lm.embed_tokens.weight.element_size()
    vision = getattr(model, "visual", None) or getattr(model, "vision_tower", None)
    vit_params = _matmul_params(_linear_layers(vision) + _linear_layers(getattr(model, "multi_modal_projector",
                                                                                None)))
    vc = getattr(model.config, "vision_config", None)  # None: no vision transformer (Fuyu's patch projection)
    depth = int(getattr(vc, "depth", None) or getattr(vc, "num_hidden_layers", 0))
    # Qwen2-VL names the ViT width embed_dim (its hidden_size is the merger's output); others hidden_size.
    width = int(getattr(vc, "embed_dim", None) or getattr(vc, "hidden_size", 0))
    full_layers, window_patches = -1, 0
    if getattr(vc, "fullatt_block_indexes", None) is not None and getattr(vc, "window_size", None):
        full_layers = len(vc.fullatt_block_indexes)
        window_patches = (int(vc.window_size) // int(vc.patch_size)) ** 2
    return ModelCost(
        lm_weight_bytes=_stored_bytes(lm_layers) + head_bytes,
        lm_matmul_params=_matmul_params(lm_layers), lm_head_params=head_params,
        num_layers=spec.num_layers, num_heads=attn.num_heads, head_dim=spec.head_dim,
        kv_bytes_per_token=2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * kv_elem,
        vit_matmul_params=vit_params, vit_depth=depth, vit_width=width, vit_full_layers=full_layers,
        vit_window_patches=window_patches)


def prefill_flops(cost: ModelCost, num_tokens: int, context: int = 0, num_sampled: int = 1) -> float:
    """FLOPs of prefilling num_tokens after `context` cached tokens (causal attention)."""
    linear = 2.0 * num_tokens * cost.lm_matmul_params + 2.0 * num_sampled * cost.lm_head_params
    # QK^T and PV: 2 matmuls x 2 FLOPs x heads x head_dim x (keys seen by each query).
    keys_seen = num_tokens * context + num_tokens * (num_tokens + 1) / 2
    attention = 4.0 * cost.num_layers * cost.num_heads * cost.head_dim * keys_seen
    return linear + attention


def vision_flops(cost: ModelCost, num_patches: int) -> float:
    """ViT FLOPs for one image of num_patches patches. A windowed layer counts every window as whole (an image's
    edge windows may be partial: an upper bound)."""
    full = cost.vit_depth if cost.vit_full_layers < 0 else cost.vit_full_layers
    window = min(cost.vit_window_patches or num_patches, num_patches)
    keys_seen = full * num_patches ** 2 + (cost.vit_depth - full) * num_patches * window
    return 2.0 * num_patches * cost.vit_matmul_params + 4.0 * cost.vit_width * keys_seen


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

    def achieved(self, summary: Mapping[str, Any]) -> dict[str, float | None]:
        return achieved(summary, self)


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


# ---- the floor of a whole offline run ----------------------------------------------------------------------
@dataclass(frozen=True)
class RequestWork:
    """What one request of a run costs at least: its prompt, its answer, the images only it brings."""

    prompt_tokens: int
    output_tokens: int
    image_patches: tuple[int, ...] = ()
    """Patches of each image the vision tower must run for this request (an image an earlier request of the run
    brought is not encoded again, so it is left out here)."""


def min_decode_steps(decode_tokens: Sequence[int], max_num_seqs: int) -> int:
    """Fewest steps that decode every request's tokens, one token per sequence per step and at most max_num_seqs
    sequences a step: max(the longest request, ceil(all tokens / max_num_seqs)). Both bounds are necessary, and
    together sufficient: fill the steps' slots request after request, wrapping a request to the next slot row
    (it never meets itself in a step, being no longer than the step count)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    tokens = [max(0, int(n)) for n in decode_tokens]
    return max(max(tokens, default=0), math.ceil(sum(tokens) / max_num_seqs))


@dataclass
class RunFloor:
    """The least time a run of these requests can take on this hardware, and the output tok/s that gives.

    Sum model, as the offline floors of the benchmark notes were derived: floor_s = compute_s + memory_s, with
    compute_s every FLOP of the run at peak (prefill linear + causal attention of each prompt, the ViT of each
    image, decode linear + attention of each generated token) and memory_s the decode steps' bytes at bandwidth
    (the language-model weights once per decode step + every decode token's KV context). Prefill and the ViT are
    compute-bound and decode bandwidth-bound, so a step does one or the other at its limit; `roofline_s` =
    max(compute_s, memory_s) is the stricter bound of an engine that hid all decode traffic under prefill math.
    The decode steps are the fewest max_num_seqs allows (`min_decode_steps`); the first token of each request
    comes from its prefill. Not counted: prefill's weight and KV traffic, activations, norms, the sampler. The
    ViT's attention is full (windowed towers do less), and no prefix-cache reuse is assumed, so a workload of
    repeated prompts can run above 100% of it."""

    num_requests: int
    output_tokens: int
    prefill_flops: float
    vision_flops: float
    decode_flops: float
    decode_steps: int
    decode_weight_bytes: float
    decode_kv_bytes: float
    compute_s: float
    memory_s: float
    floor_s: float
    roofline_s: float
    floor_output_throughput: float | None
    """Output tokens per second of floor_s."""
    max_num_seqs: int
    bandwidth: float
    peak_flops: float

    def achieved(self, summary: Mapping[str, Any]) -> dict[str, float | None]:
        """The floor beside the measured output tok/s: achieved = measured / floor tok/s (1.0 = at the limit)."""
        measured = summary.get("output_throughput")
        fraction = measured / self.floor_output_throughput if measured and self.floor_output_throughput else None
        return {**asdict(self), "achieved_throughput_fraction": fraction}


def _decode_context_tokens(prompt: int, decode: int) -> float:
    """Keys the decode tokens of one request see: token j (1..decode) attends to prompt + j positions."""
    return decode * prompt + decode * (decode + 1) / 2


def run_floor(cost: ModelCost, work: Sequence[RequestWork], max_num_seqs: int, bandwidth: float = H200_BANDWIDTH,
              peak_flops: float = H200_BF16_FLOPS) -> RunFloor:
    """The floor of a run that processed these requests with at most max_num_seqs sequences a decode step."""
    prefill = vision = decode = kv_tokens = 0.0
    attention_per_key = 4.0 * cost.num_layers * cost.num_heads * cost.head_dim
    decode_tokens = [max(0, w.output_tokens - 1) for w in work]
    for w, n in zip(work, decode_tokens):
        prefill += prefill_flops(cost, w.prompt_tokens, num_sampled=1 if w.output_tokens else 0)
        vision += sum(vision_flops(cost, p) for p in w.image_patches)
        keys = _decode_context_tokens(w.prompt_tokens, n)
        decode += n * 2.0 * (cost.lm_matmul_params + cost.lm_head_params) + attention_per_key * keys
        kv_tokens += keys
    steps = min_decode_steps(decode_tokens, max_num_seqs)
    weight_bytes, kv_bytes = float(steps * cost.lm_weight_bytes), kv_tokens * cost.kv_bytes_per_token
    compute_s = (prefill + vision + decode) / peak_flops
    memory_s = (weight_bytes + kv_bytes) / bandwidth
    output = sum(w.output_tokens for w in work)
    floor_s = compute_s + memory_s
    return RunFloor(num_requests=len(work), output_tokens=output, prefill_flops=prefill, vision_flops=vision,
                    decode_flops=decode, decode_steps=steps, decode_weight_bytes=weight_bytes,
                    decode_kv_bytes=kv_bytes, compute_s=compute_s, memory_s=memory_s, floor_s=floor_s,
                    roofline_s=max(compute_s, memory_s), floor_output_throughput=output / floor_s if floor_s else None,
                    max_num_seqs=max_num_seqs, bandwidth=bandwidth, peak_flops=peak_flops)


def run_work(records: Sequence[Any], requests: Sequence[Any]) -> list[RequestWork]:
    """The successful requests of a run (RequestRecords) as RequestWork; each image is charged to the first
    request that brings it (BenchRequest.image_keys: equal keys are the same picture)."""
    keys = {r.request_id: r.image_keys for r in requests}
    seen: set[str] = set()
    work = []
    for rec in records:
        if not rec.success:
            continue
        image_keys = keys.get(rec.request_id) or [None] * len(rec.image_patches)
        patches = []
        for key, n in zip(image_keys, rec.image_patches):
            if key is None or key not in seen:
                patches.append(n)
            if key is not None:
                seen.add(key)
        work.append(RequestWork(rec.prompt_tokens, rec.output_tokens, tuple(patches)))
    return work
