"""A tiny Qwen2-VL checkpoint in compressed-tensors' INT8 W8A8 (`int-quantized`) format, written directly.

What llm-compressor's W8A8 recipe leaves on disk, without its calibration: the language model's projections
hold `weight` (int8, (N, K)) and `weight_scale` ((N, 1), the checkpoint's dtype); with static activations also
`input_scale` ((1,)). The LM head and the vision tower stay float, named in the config's `ignore` list. Weights
are rounded the way compressed-tensors rounds them: scale = amax / 127.5 per output channel, integers clamped to
[-128, 127], so -128 occurs as it does in real checkpoints.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from flashvlm.testing.tiny_qwen import build_qwen2_vl

QUANTIZED_WEIGHT = re.compile(r"^(model\.)?(language_model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|"
                              r"mlp\.(gate|up|down)_proj)\.weight$")
"""The language model's projection weights, in any of the layouts Qwen2-VL checkpoints use."""
STATIC_INPUT_SCALES = {"q_proj": 0.031, "k_proj": 0.027, "v_proj": 0.035, "o_proj": 0.02, "gate_proj": 0.03,
                       "up_proj": 0.026, "down_proj": 0.012}
"""Per-tensor activation scales of the static variant, by projection: q, k and v differ on purpose, so a loader
that merges them must choose between them."""


def int8_quantization_config(static_activations: bool = False) -> dict[str, Any]:
    """The quantization_config llm-compressor writes for its W8A8 preset (static: per-tensor input scales)."""
    acts = ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
            if static_activations else
            {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True})
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
               "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
    acts.update({"group_size": None, "block_structure": None, "actorder": None,
                 "observer": None if not static_activations else "minmax"})
    return {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": "int-quantized"}},
        "ignore": ["lm_head", "re:.*visual.*"], "kv_cache_scheme": None, "global_compression_ratio": None,
        "sparsity_config": {}, "transform_config": {},
    }


def quantize_channels_like_compressed_tensors(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 (N, K), float32 (N, 1)): symmetric scale amax / 127.5 per row, round half to even, [-128, 127]."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.5
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(w / scale).clamp(-128, 127).to(torch.int8), scale


def build_int8_qwen2_vl(path: str | Path, *, static_activations: bool = False, seed: int = 0,
                        **kwargs: Any) -> Path:
    """A tiny float Qwen2-VL checkpoint (testing/tiny_qwen.py), its projections then rewritten as int8."""
    from safetensors.torch import load_file, save_file

    path = build_qwen2_vl(path, seed=seed, **kwargs)
    files = sorted(path.glob("model*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    for f in path.glob("model*.safetensors*"):
        f.unlink()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not QUANTIZED_WEIGHT.match(name):
            out[name] = tensor
            continue
        prefix = name[: -len(".weight")]
        q, scale = quantize_channels_like_compressed_tensors(tensor)
        out[name] = q
        out[f"{prefix}.weight_scale"] = scale.to(tensor.dtype)
        if static_activations:
            projection = prefix.rsplit(".", 1)[1]
            out[f"{prefix}.input_scale"] = torch.tensor([STATIC_INPUT_SCALES[projection]], dtype=tensor.dtype)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = int8_quantization_config(static_activations)
    config_file.write_text(json.dumps(config, indent=1))
    return path
