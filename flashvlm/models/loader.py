"""Loading a Hugging Face checkpoint folder: config, weights, tokenizer, chat template, processor and
generation defaults."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flashvlm.config import ConfigError, ModelConfig
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.sharded_load import loads_sharded, local_config, narrow_checkpoint
from flashvlm.layers.mlp import pad_unaligned_mlps
from flashvlm.models.interfaces import VLModel
from flashvlm.models.registry import ModelFamily, resolve_family
from flashvlm.models.weight_utils import (
    check_all_loaded,
    checkpoint_tensor_names,
    init_dummy_weights,
    iterate_checkpoint,
)
from flashvlm.quant.apply import finish_loading, prepare_for_checkpoint, quantize_model
from flashvlm.quant.plan import QuantPlan

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Checkpoint:
    """Everything read from a checkpoint folder except the weights."""

    path: Path
    hf_config: Any
    tokenizer: Any
    chat_template: str | None
    preprocessor_config: dict
    generation_defaults: dict = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.hf_config.model_type

    @property
    def family(self) -> ModelFamily:
        return resolve_family(getattr(self.hf_config, "architectures", None))

    @property
    def text_config(self) -> Any:
        return getattr(self.hf_config, "text_config", self.hf_config)

    @property
    def max_position_embeddings(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", 4096))

    def eos_token_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        for source in (self.generation_defaults.get("eos_token_id"), getattr(self.text_config, "eos_token_id", None),
                       self.tokenizer.eos_token_id):
            if source is None:
                continue
            for i in source if isinstance(source, (list, tuple)) else [source]:
                if i not in ids:
                    ids.append(int(i))
        return tuple(ids)


def read_checkpoint(model_config: ModelConfig) -> Checkpoint:
    from transformers import AutoConfig, AutoTokenizer

    path = Path(model_config.model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"{path} is not a Hugging Face checkpoint folder (no config.json); "
                          "flashvlm loads local folders only, never from a hub")
    try:
        hf_config = AutoConfig.from_pretrained(path, **model_config.hf_overrides)
    except (ValueError, KeyError) as e:
        raise ConfigError(f"cannot parse {path / 'config.json'}: {e}") from e
    family = resolve_family(getattr(hf_config, "architectures", None))  # fail fast on an unknown architecture
    tokenizer = AutoTokenizer.from_pretrained(path)
    checkpoint = Checkpoint(path=path, hf_config=hf_config, tokenizer=tokenizer,
                            chat_template=_find_chat_template(path, tokenizer),
                            preprocessor_config=_read_image_processor_config(path),
                            generation_defaults=_read_json(path / "generation_config.json"))
    family.check_checkpoint(checkpoint)
    return checkpoint


def _read_image_processor_config(path: Path) -> dict:
    """preprocessor_config.json, else the "image_processor" section of processor_config.json: transformers 5's
    ProcessorMixin.save_pretrained may write only the latter, and the defaults would not fit the model."""
    if (path / "preprocessor_config.json").is_file():
        return _read_json(path / "preprocessor_config.json")
    section = _read_json(path / "processor_config.json").get("image_processor")
    if isinstance(section, dict):
        return section
    logger.warning("%s has neither preprocessor_config.json nor an image_processor section in "
                   "processor_config.json: images are preprocessed with the family's default settings", path)
    return {}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _find_chat_template(path: Path, tokenizer: Any) -> str | None:
    """chat_template.jinja, then chat_template.json, then tokenizer_config.json (via the tokenizer)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        template = _read_json(path / "chat_template.json").get("chat_template")
        if template:
            return template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: take the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template


def resolve_dtype(model_config: ModelConfig, hf_config: Any, device: str) -> torch.dtype:
    if model_config.dtype != "auto":
        return _DTYPES[model_config.dtype]
    if device.startswith("cpu"):
        return torch.float32
    text_config = getattr(hf_config, "text_config", hf_config)
    dtype = getattr(hf_config, "dtype", None) or getattr(text_config, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.bfloat16)
    return dtype if dtype in _DTYPES.values() else torch.bfloat16


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, checkpoint: Checkpoint, device: str, dtype: torch.dtype,
               quant_plan: QuantPlan | None = None, tp_group: TPGroup | None = None) -> VLModel:
    """Build the family's model and fill it. With a quantization plan, a pre-quantized checkpoint gets its
    quantized layers swapped in before loading; float weights (a float checkpoint, or random weights for a
    benchmark of any plan) are rounded after. With a tensor-parallel group whose decoder loads per rank
    (distributed/sharded_load.py), the model is built with this rank's widths and reads only its slices (random
    weights are then drawn per slice); the caller's pass (distributed/shard.py) finishes the split, and with more
    than one rank the caller also rounds float weights, after the split (distributed/quant_shard.py)."""
    cls = checkpoint.family.model_class()
    local = tp_group is not None and loads_sharded(checkpoint.hf_config, tp_group)
    round_here = quant_plan is not None and (tp_group is None or tp_group.size == 1)
    hf_config = local_config(checkpoint.hf_config, tp_group) if local else checkpoint.hf_config
    with torch.device(device), _default_dtype(dtype):
        model = cls(hf_config)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, model_config.seed)
        pad_unaligned_mlps(model)
        if round_here:
            quantize_model(model, quant_plan)
        return model.eval()
    prequantized = quant_plan is not None and quant_plan.prequantized
    if prequantized:
        prepare_for_checkpoint(model, quant_plan, checkpoint_tensor_names(checkpoint.path))
    weights = iterate_checkpoint(checkpoint.path)
    if local:
        weights = narrow_checkpoint(weights, checkpoint.hf_config, tp_group, quant_plan)
    filled = model.load_weights((name, t.to(device)) for name, t in weights)
    check_all_loaded(model, filled)
    pad_unaligned_mlps(model)
    if prequantized:
        finish_loading(model)
    elif round_here:
        quantize_model(model, quant_plan)
    return model.eval()
