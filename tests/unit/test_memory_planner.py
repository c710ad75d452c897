"""The KV budget's reserves: each named quantity adds up to what the runner reserved before the split, and the
decode-graph reserve covers what the 7B config's decode graphs were measured to take."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flashvlm.attention.reference import ReferenceBackend
from flashvlm.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from flashvlm.models.interfaces import KVCacheSpec
from flashvlm.runner.memory_planner import GraphReserves, MemoryPlanner
from flashvlm.runner.sampler import Sampler

MiB = 2**20
QWEN2_VL_7B = dict(num_layers=28, kv_heads=4, head_dim=128, vocab=152064, hidden=3584)


def _model(num_layers: int, kv_heads: int, head_dim: int, vocab: int, hidden: int,
           vision_graphable: bool = True) -> SimpleNamespace:
    spec = KVCacheSpec(num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim)
    return SimpleNamespace(kv_cache_spec=lambda: spec, vocab_size=vocab, vision_graphable=vision_graphable,
                           language_model=SimpleNamespace(embed_tokens=torch.nn.Embedding(1, hidden)),
                           embedding_width=hidden)


def _planner(graphs: bool = True, max_num_seqs: int = 256, prefill_graph_max_tokens: int = 2048,
             vision_graphs: int = 4, **cache: object) -> MemoryPlanner:
    config = EngineConfig(model=ModelConfig(model="unused"), device="cpu", cache=CacheConfig(**cache),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
                          prefill_graph_max_tokens=prefill_graph_max_tokens, vision_graphs=vision_graphs)
    return MemoryPlanner(config, _model(**QWEN2_VL_7B), torch.bfloat16, ReferenceBackend(), Sampler(),
                         max_model_len=4096, use_cuda_graphs=graphs)


def _reserve_before_the_split(n: int, layers: int, vocab: int, step_tokens: int, vision: bool) -> int:
    """ModelRunner.graph_memory_reserve's formula, as written before the reserves had names."""
    decode = 256 * 2**20 + 3 * n * vocab * 4 + n * layers * 2**17
    step = 256 * 2**20 + step_tokens * 2**16 + 3 * n * vocab * 4 if step_tokens >= 16 else 0
    return decode + step + (2**30 if vision else 0)


def test_wider_input_rows_grow_the_step_reserve() -> None:
    """Qwen3-VL-8B's rows carry 3 DeepStack features: the step graphs' buffer and the decoder's split of it."""
    planner = _planner(prefill_graph_max_tokens=2048)
    before = planner.graph_reserves().step
    planner.model.embedding_width = 4 * 3584
    assert planner.graph_reserves().step - before == 2 * 2048 * 3 * 3584 * 2


def test_the_decode_reserve_covers_the_7b_measurement() -> None:
    reserve = _planner().decode_graph_reserve()
    assert reserve == 256 * MiB + 3 * 256 * 152064 * 4 + 256 * 28 * 128 * 1024
    assert round(reserve / MiB) == 1598 and reserve > 1422 * MiB  # 1,422 MiB measured on the H200


@pytest.mark.parametrize("seqs,step_tokens,vision", [(256, 2048, 4), (8, 8, 0), (64, 512, 0), (1, 0, 4)])
def test_named_reserves_add_up_to_the_old_formula(seqs: int, step_tokens: int, vision: int) -> None:
    planner = _planner(max_num_seqs=seqs, prefill_graph_max_tokens=step_tokens, vision_graphs=vision)
    expected = _reserve_before_the_split(seqs, 28, 152064, step_tokens, vision > 0)
    assert planner.graph_reserves().total == expected


def test_eager_engines_reserve_nothing_for_graphs() -> None:
    assert _planner(graphs=False).graph_reserves() == GraphReserves(0, 0, 0)


def test_cpu_and_fixed_kv_sizes() -> None:
    assert _planner(max_num_seqs=4).determine_num_blocks() == 4096 * 4 // 16 + 2
    assert _planner(max_num_seqs=64).determine_num_blocks() == 4096 * 8 // 16 + 2  # at most 8 sequences on CPU
    assert _planner(kv_cache_tokens=1000).determine_num_blocks() == 1000 // 16 + 1  # + the null block
    planner = _planner()
    assert planner.kv_bytes_per_block() == 2 * 28 * 16 * 4 * 128 * 2
    assert planner.embedding_cache_bytes() == 8192 * 3584 * 2  # 56 MiB: the encoder cache's default budget
    planner.model.embedding_width = 4 * 4096  # Qwen3-VL-8B: the embedding and 3 DeepStack features a row
    assert planner.embedding_cache_bytes() == 8192 * 4 * 4096 * 2


@pytest.mark.parametrize("free_gib", [30.0, 61.5])
def test_an_fp8_cache_gets_twice_the_blocks_of_bf16_in_the_same_memory(monkeypatch, free_gib: float) -> None:
    """The GPU path with the device's memory and the profile stubbed: the same budget, half the bytes a block, twice
    the blocks (1 byte an element for e4m3, 2 for bf16)."""
    total = 141 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free_gib * 2**30), total))
    blocks = {}
    for kv in ("auto", "fp8"):
        config = EngineConfig(model=ModelConfig(model="unused"), device="cuda", cache=CacheConfig(kv_cache_dtype=kv))
        planner = MemoryPlanner(config, _model(**QWEN2_VL_7B), torch.bfloat16, ReferenceBackend(), Sampler(),
                                max_model_len=4096, use_cuda_graphs=False)
        monkeypatch.setattr(planner, "profile_peak_memory", lambda items: 3 * 2**30)
        blocks[kv] = planner.determine_num_blocks()
        assert planner.kv_bytes_per_block() == 2 * 28 * 16 * 4 * 128 * (2 if kv == "auto" else 1)
    budget = total * 0.9 - (total - free_gib * 2**30) - 3 * 2**30 - 8192 * 3584 * 2
    assert blocks["auto"] == int(budget // (2 * 28 * 16 * 4 * 128 * 2))
    assert blocks["fp8"] == int(budget // (2 * 28 * 16 * 4 * 128))
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1)  # the same budget, floored per block size
