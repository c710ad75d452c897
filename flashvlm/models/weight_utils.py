"""Reading checkpoint tensors and filling a model's parameters by name."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from flashvlm.config import ConfigError
from flashvlm.layers.attention import PagedAttention
from flashvlm.models.interfaces import MissingWeightError

logger = logging.getLogger(__name__)

_HARMLESS_EXTRAS = re.compile(r"(^|\.)(inv_freq|position_ids)$")
"""Checkpoint tensors no model here needs, whatever the family: rotary tables and position-id buffers that
older saves carry and that are recomputed at load."""
_SHOWN_NAMES = 5


def checkpoint_files(path: str | Path) -> list[Path]:
    """Safetensors files of a checkpoint folder: sharded through the index when there is one."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (use load_format='dummy' for random weights)")
    return files


def iterate_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = checkpoint_files(path)
    if not (Path(path) / "model.safetensors.index.json").exists():
        _check_no_duplicate_tensors(files)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, st.get_tensor(name)


def _check_no_duplicate_tensors(files: list[Path]) -> None:
    """Without an index every *.safetensors file is read, so a stray copy (an old export, a consolidated file
    next to the shards) would silently overwrite tensors depending on file order. Reads headers only."""
    from safetensors import safe_open

    owner: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                if name in owner:
                    raise ConfigError(
                        f"tensor {name!r} is in both {owner[name].name} and {f.name} of {f.parent}, which has no "
                        "model.safetensors.index.json to choose between them; remove the extra file or add an index")
                owner[name] = f


def load_params(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                rename: Callable[[str], str | None],
                packed: dict[str, tuple[str, int]] | None = None,
                expected_unused: Callable[[str], bool] = lambda name: False) -> set[str]:
    """Copy checkpoint tensors into `model`.

    rename maps a checkpoint name to a parameter name (None = skip the tensor). `packed` maps a
    projection name (e.g. "q_proj") to (packed module name, shard) for MergedLinear layers.
    Skipped tensors are logged once unless `expected_unused` (or the family-independent list) knows
    them: an unrecognised name usually means a layout we misread, not a tensor to ignore.
    Returns the filled parameter names; a packed parameter counts once all its shards arrived.
    """
    params = dict(model.named_parameters())
    packed = packed or {}
    filled: set[str] = set()
    shards_seen: dict[str, set[int]] = {}
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        hit = None if name is None else _packed_hit(name, packed)
        if name is not None and hit is None and name not in params and _load_kv_scale(model, name, tensor):
            continue
        if name is None or (hit is None and name not in params):
            if not (_HARMLESS_EXTRAS.search(ckpt_name) or expected_unused(ckpt_name)):
                unexpected.append(ckpt_name)
            continue
        if hit is not None:
            parts = name.split(".")
            i, (packed_name, shard) = hit
            module_path, param_name = ".".join(parts[:i] + [packed_name]), parts[-1]
            module = model.get_submodule(module_path)
            if not hasattr(module, "load_shard"):  # a MergedLinear, or a quantized layer built from one
                raise TypeError(f"{module_path} is not a MergedLinear")
            with torch.no_grad():
                module.load_shard(param_name, shard, tensor)
            full = f"{module_path}.{param_name}"
            shards_seen.setdefault(full, set()).add(shard)
            if len(shards_seen[full]) == len(module.out_sizes):
                filled.add(full)
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if hasattr(owner, "load_tensor"):  # a quantized layer: it places its checkpoint tensors itself
            with torch.no_grad():
                owner.load_tensor(leaf, tensor)
            filled.add(name)
            continue
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"weight {ckpt_name}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        filled.add(name)
    if unexpected:
        shown = ", ".join(unexpected[:_SHOWN_NAMES]) + (" ..." if len(unexpected) > _SHOWN_NAMES else "")
        logger.warning("%d checkpoint tensor(s) match no parameter of %s and were not loaded: %s",
                       len(unexpected), type(model).__name__, shown)
    return filled


def module_of(param_name: str, packed: dict[str, tuple[str, int]]) -> str:
    """The module a parameter name (after renaming) belongs to; a packed projection's shard names its merged
    module (`...self_attn.q_proj.weight` -> `...self_attn.qkv_proj`)."""
    parts = param_name.split(".")
    hit = _packed_hit(param_name, packed)
    if hit is not None:
        i, (packed_name, _) = hit
        return ".".join(parts[:i] + [packed_name])
    return ".".join(parts[:-1])


def checkpoint_tensor_names(path: str | Path) -> list[str]:
    """Every tensor name of a checkpoint folder, read from the safetensors headers only."""
    from safetensors import safe_open

    names: list[str] = []
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as st:
            names.extend(st.keys())
    return names


_KV_SCALES = ("k_scale", "v_scale")
_KV_ZERO_POINTS = ("k_zero_point", "v_zero_point")


def _load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """An FP8 KV cache's per-layer scale as compressed-tensors stores it on the attention module
    (`...self_attn.k_scale` / `v_scale`, shape (1,), often in the model's dtype): copied as float32 into the
    layer's PagedAttention buffer. False when `name` is neither a KV scale nor a KV zero point."""
    module_path, _, leaf = name.rpartition(".")
    if leaf not in _KV_SCALES + _KV_ZERO_POINTS:
        return False
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return False
    attn = module if isinstance(module, PagedAttention) else next(
        (m for m in module.children() if isinstance(m, PagedAttention)), None)
    if attn is None:
        return False
    if leaf in _KV_ZERO_POINTS:
        return True  # zeros in the symmetric schemes flashvlm runs (an asymmetric one is refused at start-up)
    if tensor.numel() != 1:
        # Per-head or per-channel scales: an FP8 cache refuses a scheme declaring them at start-up
        # (`checkpoint_kv_scheme`); undeclared, its scales are calibrated instead; a model-dtype cache reads none.
        logger.warning("%s has shape %s: flashvlm reads one K and one V scale per layer, so it is not used",
                       name, tuple(tensor.shape))
        return True
    with torch.no_grad():
        getattr(attn, leaf).copy_(tensor.reshape(1).float())
    return True


def _packed_hit(name: str, packed: dict[str, tuple[str, int]]) -> tuple[int, tuple[str, int]] | None:
    """(index of the name component, (packed module, shard)) when `name` is a shard of a MergedLinear."""
    return next(((i, packed[p]) for i, p in enumerate(name.split(".")) if p in packed), None)


def check_all_loaded(model: nn.Module, filled: set[str]) -> None:
    missing = sorted(set(dict(model.named_parameters())) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise MissingWeightError(f"checkpoint is missing {len(missing)} weight tensor(s): {shown}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Seeded random weights for benchmarks: small normals, norms near one, so activations stay finite."""
    with torch.no_grad():
        for i, (name, p) in enumerate(sorted(model.named_parameters())):
            g = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
            if p.dim() == 1 and ("norm" in name or ".ln" in name):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=g)
