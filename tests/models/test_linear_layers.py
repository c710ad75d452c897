"""Every linear layer of every family is a `layers/` class (what a quantization or sharding pass swaps), and the
vision towers' and projectors' layers compute exactly F.linear, as the nn.Linear they replace did."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

import flashvlm
from flashvlm.layers import linear as linear_layers
from flashvlm.layers.linear import PlainLinear
from flashvlm.models.registry import resolve_model_class
from flashvlm.testing.tiny_checkpoints import build_llava, build_qwen2_vl

_LAYER_CLASSES = tuple(v for v in vars(linear_layers).values() if isinstance(v, type) and issubclass(v, nn.Linear))


@pytest.mark.parametrize("build", [build_qwen2_vl, lambda p: build_qwen2_vl(p, qwen25=True), build_llava],
                         ids=["qwen2_vl", "qwen2_5_vl", "llava"])
def test_every_linear_module_is_a_layers_class(tmp_path: Path, build) -> None:
    config = transformers.AutoConfig.from_pretrained(build(tmp_path))
    model = resolve_model_class(config.architectures)(config)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linears
    assert [name for name, m in linears if type(m) not in _LAYER_CLASSES] == []


def test_no_nn_linear_outside_layers() -> None:
    root = Path(flashvlm.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.parent.name != "layers" and "nn.Linear(" in p.read_text()]
    assert offenders == []


def test_plain_linear_is_f_linear_at_few_rows() -> None:
    layer = PlainLinear(8, 4)
    assert list(layer.state_dict()) == ["weight", "bias"]
    for rows in (1, 16, 17):
        x = torch.randn(rows, 8)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not hasattr(layer, "gemv_max_rows")  # set_gemv_max_rows leaves it alone
