"""Pre-quantized FP8 checkpoints written directly in their on-disk formats, from a float tiny checkpoint: what
llm-compressor writes (compressed-tensors, `float-quantized` or, weight-only, `naive-quantized`) and transformers'
block-wise `fp8` format. Only the language model's linear layers are quantized; the LM head and the vision tower
stay float, and are listed in the config's ignore list as llm-compressor lists them.

`write_dequantized` turns such a checkpoint back into a float one (each weight times its scales), the reference
the tests compare a quantized model against. The rounding here is written independently of `flashvlm.quant`, so
the tests do not check that code against itself.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

E4M3_MAX = 448.0
_LM_LINEAR = re.compile(r"(^|\.)layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
_VISION = ("model.visual.", "visual.", "model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
           "multi_modal_projector.")
# A fixed activation scale per input of a decoder layer (static schemes): projections that read the same input
# share one, as calibration on that input gives them.
_STATIC_SCALES = {"q": 6.0, "k": 6.0, "v": 6.0, "o": 3.0, "gate": 6.0, "up": 6.0, "down": 2.0}


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale that maps amax to e4m3's largest value, floored for all-zero rows."""
    return torch.clamp(amax.float() / E4M3_MAX, min=1e-12)


def fp8_round_trip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with `scale` (broadcast) and back, in float32."""
    return torch.clamp(x.float() / scale, -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def round_activation(x: torch.Tensor, activation: str | None, input_scale: float | None = None,
                     group: int | None = None) -> torch.Tensor:
    """What an FP8 scheme makes of a linear layer's input (..., K), in float32: dynamic, rounded per token
    (per token and `group` columns); static, with the layer's one input scale; None (weight-only), unchanged."""
    if activation is None:
        return x.float()
    if activation == "static":
        return fp8_round_trip(x, torch.tensor(float(input_scale)))
    if group is None:
        return fp8_round_trip(x, fp8_scale(x.abs().amax(dim=-1, keepdim=True)))
    parts = [fp8_round_trip(c, fp8_scale(c.abs().amax(dim=-1, keepdim=True))) for c in x.split(group, dim=-1)]
    return torch.cat(parts, dim=-1)


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _copy_folder(src: Path, dst: Path) -> None:
    """Everything but the weights: config, tokenizer, processor and generation files."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dst / f.name)


def _save(dst: Path, state: dict[str, torch.Tensor], quantization_config: dict[str, Any] | None) -> Path:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if quantization_config is None:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _ignored_modules(state: dict[str, torch.Tensor]) -> list[str]:
    """Every linear layer left float, by module name, as llm-compressor records them: the LM head and the
    vision tower's 2-D weights."""
    names = [n[: -len(".weight")] for n, t in state.items()
             if n.endswith(".weight") and t.dim() == 2 and n.startswith(_VISION)]
    return (["lm_head"] if "lm_head.weight" in state else []) + sorted(names)


def _args(strategy: str, dynamic: bool, observer: str | None, **extra: Any) -> dict[str, Any]:
    args = {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None, "num_bits": 8,
            "observer": observer, "observer_kwargs": {}, "scale_dtype": None, "strategy": strategy,
            "symmetric": True, "type": "float", "zp_dtype": None}
    args.update(extra)
    return args


def compressed_tensors_config(weight: str, activation: str | None, ignore: list[str],
                              weight_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `quantization_config` llm-compressor writes for FP8 (compressed-tensors' serialized form)."""
    weights = {**_args(weight, False, "minmax"), **(weight_overrides or {})}
    inputs = {"dynamic": _args("token", True, None), "static": _args("tensor", False, "minmax"),
              None: None}[activation]
    fmt = "float-quantized" if inputs is not None else "naive-quantized"
    return {"config_groups": {"group_0": {"format": fmt, "input_activations": inputs, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": "0.12.2"}


def _round(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.clamp(w.float() / scale, -E4M3_MAX, E4M3_MAX).to(dtype)


def write_compressed_tensors_fp8(src: str | Path, dst: str | Path, *, weight: str = "channel",
                                 activation: str | None = "dynamic", weight_dtype: torch.dtype = torch.float8_e4m3fn,
                                 weight_overrides: dict[str, Any] | None = None) -> Path:
    """The float checkpoint `src` with its language model's linear weights in FP8, as llm-compressor saves it:
    `weight` e4m3, `weight_scale` ((rows, 1) per channel, (1,) per tensor, in the checkpoint's dtype) and, static,
    `input_scale` (1,). `weight_dtype` and `weight_overrides` (config fields) write variants flashvlm refuses."""
    src, dst = Path(src), Path(dst)
    _copy_folder(src, dst)
    state = _read(src)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _LM_LINEAR.search(name)
        if match is None or name.startswith(_VISION):
            out[name] = tensor
            continue
        amax = tensor.float().abs().amax(dim=1, keepdim=True) if weight == "channel" else \
            tensor.float().abs().amax().reshape(1)
        scale = fp8_scale(amax)
        module = name[: -len(".weight")]
        out[name] = _round(tensor, scale if weight == "channel" else scale.reshape(1, 1), weight_dtype)
        out[f"{module}.weight_scale"] = scale.to(tensor.dtype)
        if activation == "static":
            out[f"{module}.input_scale"] = torch.tensor([_STATIC_SCALES[match.group(3)] / E4M3_MAX],
                                                        dtype=tensor.dtype)
    return _save(dst, out, compressed_tensors_config(weight, activation, _ignored_modules(state), weight_overrides))


def write_transformers_fp8(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """The float checkpoint `src` in transformers' fp8 format: language-model linear weights e4m3 with a float32
    `weight_scale_inv` per (block rows x block columns) tile (partial tiles at the edges), dynamic activations."""
    src, dst = Path(src), Path(dst)
    _copy_folder(src, dst)
    state = _read(src)
    out: dict[str, torch.Tensor] = {}
    bn, bk = block
    for name, tensor in state.items():
        if _LM_LINEAR.search(name) is None or name.startswith(_VISION):
            out[name] = tensor
            continue
        n, k = tensor.shape
        nb, kb = -(-n // bn), -(-k // bk)
        padded = torch.zeros(nb * bn, kb * bk)
        padded[:n, :k] = tensor.float()
        tiles = padded.view(nb, bn, kb, bk)
        scale = fp8_scale(tiles.abs().amax(dim=(1, 3)))  # (nb, kb)
        q = _round(tiles, scale[:, None, :, None], torch.float8_e4m3fn).view(nb * bn, kb * bk)[:n, :k]
        out[name] = q.contiguous()
        out[name[: -len(".weight")] + ".weight_scale_inv"] = scale
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [bn, bk],
              "modules_to_not_convert": _ignored_modules(state)}
    return _save(dst, out, config)


def write_compressed_tensors_fp8_blocks(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """The blocks of `write_transformers_fp8` as llm-compressor's FP8_BLOCK saves them: compressed-tensors,
    the block scales named `weight_scale`, activations dynamic per token and group of the block's columns."""
    dst = write_transformers_fp8(src, dst, block)
    state = {n.removesuffix("_inv"): t for n, t in _read(dst).items()}
    weights = {"block_structure": list(block)}
    config = compressed_tensors_config("block", "dynamic", _ignored_modules(state), weights)
    config["config_groups"]["group_0"]["input_activations"] = _args("group", True, None, group_size=block[1])
    return _save(dst, state, config)


def dequantize_tensors(state: dict[str, torch.Tensor], block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Every FP8 weight of a checkpoint's tensors times its scales, in float32 (`block`: the (rows, columns) tile
    of block scales); scales and input scales dropped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        scale = None if module is None else state.get(f"{module}.weight_scale", state.get(f"{module}.weight_scale_inv"))
        if scale is None:
            out[name] = tensor
            continue
        w, scale = tensor.float(), scale.float()
        if block is not None:
            scale = scale.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
        else:  # (rows, 1) per channel or (1,) per tensor
            scale = scale.reshape(-1, 1)
        out[name] = w * scale
    return out


def write_dequantized(quantized: str | Path, dst: str | Path) -> Path:
    """A float32 checkpoint holding `quantized`'s weights dequantized: the float model of the same numbers."""
    quantized, dst = Path(quantized), Path(dst)
    _copy_folder(quantized, dst)
    qc = json.loads((quantized / "config.json").read_text()).get("quantization_config") or {}
    block = qc.get("weight_block_size")
    return _save(dst, dequantize_tensors(_read(quantized), None if block is None else tuple(block)), None)
