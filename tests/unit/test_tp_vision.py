"""--mm-encoder-tp-mode weights, in one process: each rank's slice of a vision tower has the local head and MLP
widths (norms, patch embedding and position table whole), and the ranks run in threads whose all-reduce is a real
sum reproduce the whole tower's output."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import CLIPVisionConfig
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

from flashvlm.config import ConfigError
from flashvlm.distributed.group import TPGroup
from flashvlm.distributed.layers import PlainRowParallelLinear, RowParallelLinear
from flashvlm.distributed.shard_vision import shard_vision
from flashvlm.models.llava import LlavaMultiModalProjector
from flashvlm.models.vision.clip import CLIPVisionTower
from flashvlm.models.vision.qwen3_vit import Qwen3VisionTower
from flashvlm.models.vision.qwen_vit import Qwen2_5VisionTower, Qwen2VisionTower

GRIDS = [(1, 4, 6), (2, 2, 2)]
QWEN = dict(num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


class _Ranks:
    """The collectives of `size` ranks running in threads of one process: a real sum, in rank order."""

    def __init__(self, size: int) -> None:
        self.size, self.slots, self.barrier = size, [None] * size, threading.Barrier(size)

    def group(self, rank: int) -> TPGroup:
        ranks = self

        class _Group(TPGroup):
            def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
                ranks.slots[rank] = x.clone()
                ranks.barrier.wait()
                total = sum(ranks.slots[1:], ranks.slots[0].clone())
                ranks.barrier.wait()
                return x.copy_(total)

        return _Group(rank, self.size)


def _qwen2() -> nn.Module:
    return Qwen2VisionTower(Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=24, mlp_ratio=2,
                                                hidden_act="quick_gelu", **QWEN))


def _qwen25() -> nn.Module:
    return Qwen2_5VisionTower(Qwen2_5_VLVisionConfig(depth=2, hidden_size=32, intermediate_size=48, out_hidden_size=24,
                                                     window_size=16, fullatt_block_indexes=[1], hidden_act="silu",
                                                     **QWEN))


def _qwen3() -> nn.Module:
    return Qwen3VisionTower(Qwen3VLVisionConfig(depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=24,
                                                num_position_embeddings=16, deepstack_visual_indexes=[0, 2],
                                                hidden_act="gelu_pytorch_tanh", **QWEN))


class _Llava(nn.Module):
    """CLIP tower and projector as LLaVA holds them (the pass walks the model's children)."""

    def __init__(self) -> None:
        super().__init__()
        cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                               image_size=16, patch_size=4)
        self.vision_tower = CLIPVisionTower(cfg, feature_layer=[-2, -1])
        self.multi_modal_projector = LlavaMultiModalProjector(64, 24, "gelu", True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.multi_modal_projector(self.vision_tower(pixels))


def _random(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def _wrap(tower: nn.Module) -> nn.Module:
    return tower if isinstance(tower, _Llava) else nn.ModuleDict({"visual": tower})


def _runner(model: nn.Module) -> Callable[[nn.Module], torch.Tensor]:
    """The model's forward on fixed inputs: two images (one of two frames) through a Qwen tower, two through LLaVA."""
    gen = torch.Generator().manual_seed(1)
    if isinstance(model, _Llava):
        pixels = torch.randn(2, 3, 16, 16, generator=gen)
        return lambda m: m(pixels)
    pixels = torch.randn(sum(t * h * w for t, h, w in GRIDS), model.visual.in_features, generator=gen)
    return lambda m: m.visual(pixels, GRIDS)


@pytest.mark.parametrize("make", [_qwen2, _qwen25, _qwen3, _Llava], ids=["qwen2", "qwen2_5", "qwen3", "llava"])
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_reproduce_the_whole_tower(make, size):
    full = _wrap(_random(make()))
    run = _runner(full)
    with torch.no_grad():
        expected = run(full)
    ranks, outs = _Ranks(size), [None] * size
    parts = [copy.deepcopy(full) for _ in range(size)]
    for r, part in enumerate(parts):
        shard_vision(part, ranks.group(r))

    def rank(r: int) -> None:
        with torch.no_grad():
            outs[r] = run(parts[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in outs:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_each_rank_holds_its_share_of_the_tower():
    part = _wrap(_random(_qwen25()))
    whole = copy.deepcopy(part)
    shard_vision(part, TPGroup(1, 2))
    block, full_block = part.visual.blocks[0], whole.visual.blocks[0]
    assert block.attn.num_heads == 2 and block.attn.head_dim == 8
    assert block.attn.qkv.weight.shape == (48, 32)  # q, k and v of 2 of the 4 heads
    torch.testing.assert_close(block.attn.qkv.weight[:16], full_block.attn.qkv.weight[16:32])  # rank 1's q rows
    assert isinstance(block.attn.proj, PlainRowParallelLinear) and block.attn.proj.weight.shape == (32, 16)
    assert block.mlp.gate_up_proj.out_sizes == [24, 24] and block.mlp.gate_up_proj.weight.shape == (48, 32)
    assert isinstance(block.mlp.down_proj, RowParallelLinear) and block.mlp.down_proj.weight.shape == (32, 24)
    assert part.visual.merger.mlp[0].weight.shape == (64, 128)
    assert part.visual.merger.mlp[2].weight.shape == (24, 64)
    # replicated: the patch embedding and the norms
    assert torch.equal(part.visual.patch_embed.proj.weight, whole.visual.patch_embed.proj.weight)
    assert torch.equal(block.norm1.weight, full_block.norm1.weight)

    llava = _Llava()
    shard_vision(llava, TPGroup(0, 2))
    layer = llava.vision_tower.encoder.layers[0]
    assert layer.self_attn.num_heads == 2 and layer.self_attn.qkv_proj.out_sizes == [16, 16, 16]
    assert layer.mlp.fc1.weight.shape == (24, 32) and layer.mlp.fc2.weight.shape == (32, 24)
    assert llava.multi_modal_projector.linear_1.weight.shape == (12, 64)
    assert llava.multi_modal_projector.linear_2.weight.shape == (24, 12)
    assert llava.vision_tower.embeddings.position_embedding.weight.shape == (17, 32)


def test_heads_the_ranks_cannot_split_are_a_config_error():
    with pytest.raises(ConfigError, match="must divide the vision tower's 4 attention heads"):
        shard_vision(_wrap(_qwen2()), TPGroup(0, 3))
