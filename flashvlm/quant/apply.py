"""The quantization pass: which linear layers a plan replaces, and the replacement itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from flashvlm.layers.linear import Linear, PlainLinear
from flashvlm.quant.base import QuantFormatError, QuantizedLinear
from flashvlm.quant.plan import QuantPlan
from flashvlm.quant.registry import get_method

VISION_ROOTS = ("visual", "vision_tower", "multi_modal_projector")
_FLOAT_LINEARS = (Linear, PlainLinear)
_CONVOLUTIONS_IN_CHECKPOINTS = ("patch_embed.proj",)
"""Linear layers that checkpoints store as convolutions (Qwen's Conv3d patch embedding, run as a linear layer over
flattened patches): quantizers that target linear layers leave them float, the tower reads their weight's dtype
for its pixels, and they see raw pixels."""


def float_targets(model: nn.Module, quantize_vision: bool) -> list[str]:
    """The language model's linear layers (not the LM head, whose few sampled rows cost little and whose
    precision every token depends on); with quantize_vision also the vision tower's and projector's."""
    names = [f"language_model.{n}" for n, m in model.language_model.named_modules()
             if isinstance(m, _FLOAT_LINEARS)]
    if quantize_vision:
        for root in VISION_ROOTS:
            sub = getattr(model, root, None)
            if sub is not None:
                names += [f"{root}.{n}" for n, m in sub.named_modules() if isinstance(m, _FLOAT_LINEARS)
                          and not n.endswith(_CONVOLUTIONS_IN_CHECKPOINTS)]
    return names


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def quantize_model(model: nn.Module, plan: QuantPlan) -> None:
    """Round the float weights of every target layer (the model's weights are already loaded)."""
    method = get_method(plan.method)
    for name in float_targets(model, plan.quantize_vision):
        replace_module(model, name, method.quantize(model.get_submodule(name), plan.scheme))


def prepare_for_checkpoint(model: nn.Module, plan: QuantPlan, checkpoint_names: Iterable[str]) -> list[str]:
    """Swap in empty quantized layers wherever the checkpoint stores a layer quantized, before loading.
    Returns the swapped module names. Which layers are quantized is read from the tensors themselves, so a
    checkpoint's ignore list (an unquantized LM head, vision tower or layer) needs no parsing."""
    method = get_method(plan.method)
    modules: set[str] = set()
    for ckpt_name in checkpoint_names:
        if method.is_quantized_tensor(ckpt_name):
            module = model.checkpoint_module(ckpt_name)
            if module is None:
                raise QuantFormatError(f"quantized tensor {ckpt_name!r} belongs to no layer of "
                                       f"{type(model).__name__}")
            modules.add(module)
    if not modules:
        raise QuantFormatError(f"the checkpoint declares {plan.method} quantization ({plan.source}) but holds no "
                               "quantized tensors")
    for name in sorted(modules):
        layer = model.get_submodule(name)
        if not isinstance(layer, _FLOAT_LINEARS):
            raise QuantFormatError(f"{name} is stored quantized but is a {type(layer).__name__}, not a linear layer")
        replace_module(model, name, method.empty_layer(layer, plan.scheme))
    return sorted(modules)


def finish_loading(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.finish_loading()


def quantization_summary(model: nn.Module, plan: QuantPlan) -> dict[str, Any]:
    """For results.json and logs: the plan, how many layers run quantized and in which formats, and which
    linear layers stay in the model's dtype."""
    quantized: dict[str, int] = {}
    kept: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            key = ", ".join(f"{k}={v}" for k, v in module.describe().items())
            quantized[key] = quantized.get(key, 0) + 1
        elif isinstance(module, _FLOAT_LINEARS):
            kept.append(name)
    roots = sorted({n.split(".")[0] for n in kept})
    return {**plan.to_dict(), "quantized_layers": quantized, "num_quantized": sum(quantized.values()),
            "float_linear_layers": len(kept), "float_linear_roots": roots}
