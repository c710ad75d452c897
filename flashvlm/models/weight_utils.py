"""Reading checkpoint tensors and filling a model's parameters by name."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from flashvlm.layers.linear import MergedLinear
from flashvlm.models.interfaces import MissingWeightError


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

    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, st.get_tensor(name)


def load_params(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                rename: Callable[[str], str | None],
                packed: dict[str, tuple[str, int]] | None = None) -> set[str]:
    """Copy checkpoint tensors into `model`.

    rename maps a checkpoint name to a parameter name (None = skip the tensor). `packed` maps a
    projection name (e.g. "q_proj") to (packed module name, shard) for MergedLinear layers.
    Returns the filled parameter names; a packed parameter counts once all its shards arrived.
    """
    params = dict(model.named_parameters())
    packed = packed or {}
    filled: set[str] = set()
    shards_seen: dict[str, set[int]] = {}
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        parts = name.split(".")
        hit = next(((i, packed[p]) for i, p in enumerate(parts) if p in packed), None)
        if hit is not None:
            i, (packed_name, shard) = hit
            module_path, param_name = ".".join(parts[:i] + [packed_name]), parts[-1]
            module = model.get_submodule(module_path)
            if not isinstance(module, MergedLinear):
                raise TypeError(f"{module_path} is not a MergedLinear")
            with torch.no_grad():
                module.load_shard(param_name, shard, tensor)
            full = f"{module_path}.{param_name}"
            shards_seen.setdefault(full, set()).add(shard)
            if len(shards_seen[full]) == len(module.out_sizes):
                filled.add(full)
            continue
        if name not in params:
            continue  # e.g. rotary inv_freq buffers some checkpoints carry
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(f"weight {ckpt_name}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        filled.add(name)
    return filled


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
