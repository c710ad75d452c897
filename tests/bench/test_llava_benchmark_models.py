"""The real-size LLaVA benchmark folders (`--benchmark-model llava-1.5-7b`, `llava-v1.6-mistral-7b`): they load
through our loader and input processor, give the hub models' token counts for a 1008x756 picture, and build the
same network as transformers (parameters matched name by name on the meta device, no 7B allocated)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm.bench.cli import BENCHMARK_MODELS
from flashvlm.bench.llava_configs import LLAVA_CONFIGS
from flashvlm.bench.model_configs import benchmark_model_names, write_benchmark_model
from flashvlm.config import ModelConfig
from flashvlm.models.loader import read_checkpoint
from flashvlm.processing.input_processor import InputProcessor

# 1008x756: LLaVA-1.5 576 tokens; LLaVA-NeXT a 2x2 tile grid (672x672), 6 of its 48 feature rows padding at
# each side: 576 + 36 * (48 + 1)
TOKENS_1008X756 = {"llava-1.5-7b": 576, "llava-v1.6-mistral-7b": 576 + 36 * 49}


def test_the_parser_lists_every_benchmark_model() -> None:
    assert benchmark_model_names() == BENCHMARK_MODELS


@pytest.mark.parametrize("name", sorted(LLAVA_CONFIGS))
def test_llava_benchmark_folder(name: str, tmp_path) -> None:
    checkpoint = read_checkpoint(ModelConfig(model=str(write_benchmark_model(name, tmp_path))))
    config = checkpoint.hf_config
    processor = InputProcessor(checkpoint, config.text_config.vocab_size, config.image_token_id)
    image = np.random.default_rng(0).integers(0, 256, (756, 1008, 3), dtype=np.uint8)
    prompt = processor.process({"prompt": checkpoint.family.image_placeholder + "Describe it.", "images": [image]})
    assert prompt.mm_items[0].num_tokens == TOKENS_1008X756[name]
    assert prompt.prompt_token_ids[0] == 1  # <s>, as the hub tokenizers add it
    assert prompt.prompt_token_ids.count(config.image_token_id) == TOKENS_1008X756[name]

    with torch.device("meta"):
        ours = checkpoint.family.model_class()(config)
        theirs = checkpoint.family.baseline_model_class()(config)
    mapped = {}
    for hf_name, param in theirs.state_dict().items():
        target = ours._param_name(hf_name)
        if target is not None:
            mapped[target] = mapped.get(target, 0) + param.numel()
    assert sum(p.numel() for p in ours.parameters()) == sum(mapped.values())
    assert sum(p.numel() for p in ours.language_model.parameters()) > 6.5e9
