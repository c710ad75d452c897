"""Tiny pre-quantized W4A16 checkpoints for the tests, written in compressed-tensors' `pack-quantized` format
(what llm-compressor's W4A16 presets save) without the library: the language model's projections of a float
checkpoint folder become weight_packed / weight_scale / weight_zero_point / weight_shape tensors and its
config.json gets the matching quantization_config. The vision tower and the LM head stay float, as the
presets leave them (their `ignore` list)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from flashvlm.quant.int4_format import compress, decompress

_LM_PROJECTION = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.[a-z_]+_proj\.weight$")
_VISION = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.")


def is_lm_projection(name: str) -> bool:
    return bool(_LM_PROJECTION.search(name)) and not name.startswith(_VISION)


def pack_quantized_config(group_size: int | None, symmetric: bool,
                          weight_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The quantization_config llm-compressor writes for W4A16 (group_size None: the channel strategy);
    `weight_overrides` replaces fields of its weights' arguments (tests of the variants flashvlm refuses)."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "dynamic": False, "actorder": None,
               "observer": "minmax", "observer_kwargs": {}, "block_structure": None,
               "strategy": "group" if group_size else "channel", "group_size": group_size or None}
    weights.update(weight_overrides or {})
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head", "re:.*visual.*"], "kv_cache_scheme": None, "global_compression_ratio": None}


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _write_folder(src: Path, dst: Path, tensors: dict[str, torch.Tensor], quant_config: dict | None) -> Path:
    from safetensors.torch import save_file

    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    if quant_config is not None:
        config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def write_int4_checkpoint(src: str | Path, dst: str | Path, group_size: int | None = 32, symmetric: bool = True,
                          dequantized_copy: str | Path | None = None,
                          weight_overrides: dict[str, Any] | None = None) -> Path:
    """Quantize the float checkpoint folder `src` into `dst` (round to nearest, the library's conventions).
    With `dequantized_copy`, also write a float checkpoint there whose projections hold the weights the
    quantized tensors stand for (dequantized in the checkpoint's dtype): the plain-torch reference model."""
    src, dst = Path(src), Path(dst)
    tensors = _read_tensors(src)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not is_lm_projection(name):
            quantized[name] = dequantized[name] = t
            continue
        prefix = name[: -len("weight")]
        layer = compress(t, group_size or t.shape[1], symmetric)
        quantized.update({prefix + k: v for k, v in layer.items()})
        dequantized[name] = decompress(layer, group_size or t.shape[1], t.dtype)
    if dequantized_copy is not None:
        _write_folder(src, Path(dequantized_copy), dequantized, None)
    return _write_folder(src, dst, quantized, pack_quantized_config(group_size, symmetric, weight_overrides))
