"""Tensor parallelism on CPU: 2 (or 4) processes over gloo on the tiny checkpoints give the greedy tokens of
tensor_parallel_size 1 (float32) with either vision-tower mode, and a failing rank gives a clear error and leaves no
process behind. Pre-quantized checkpoints: test_tensor_parallel_prequantized.py."""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.config import ConfigError, EngineConfig
from flashvlm.distributed.encoder import shares
from flashvlm.distributed.group import TensorParallelError, TPGroup
from flashvlm.distributed.layers import RowParallelLinear
from flashvlm.distributed.shard import head_split
from flashvlm.request import MMItem
from flashvlm.testing.tiny_checkpoints import build_fuyu, build_llava, build_llava_next, build_qwen2_vl, build_qwen3_vl

QWEN = "<|vision_start|><|image_pad|><|vision_end|>"
FAMILIES = {"qwen2_vl": (build_qwen2_vl, QWEN), "qwen2_5_vl": (functools.partial(build_qwen2_vl, qwen25=True), QWEN),
            "qwen3_vl": (build_qwen3_vl, QWEN), "llava": (build_llava, "<image>\n"),
            "llava_next": (build_llava_next, "<image>\n"), "fuyu": (build_fuyu, "|SPEAKER|")}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
OPTIONS = {"device": "cpu", "dtype": "float32", "kv_cache_tokens": 2048, "distributed_timeout_s": 60}


def _image(w: int, h: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _prompts(placeholder: str, max_images: int) -> list:
    # Three images in one step: ranks encode unequal shares (2 and 1) of them.
    prompts = [{"prompt": placeholder + "describe the picture", "images": [_image(56, 112, 0)]},
               "a prompt without an image, long enough to differ"]
    if max_images > 1:
        prompts.append({"prompt": placeholder * 2 + "two", "images": [_image(140, 84, 1), _image(84, 84, 2)]})
    return prompts


def _tokens(path, size: int, prompts: list, params: SamplingParams = GREEDY, **options) -> list[list[int]]:
    with LLM(str(path), tensor_parallel_size=size, **OPTIONS, **options) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _parity(tmp_path, family: str, size: int = 2, modes: tuple[str, ...] = ("data", "weights"), **build) -> None:
    builder, placeholder = FAMILIES[family]
    path = builder(tmp_path / family, **build)
    prompts = _prompts(placeholder, 1 if family == "fuyu" else 2)
    single = _tokens(path, 1, prompts)
    for mode in modes:
        assert _tokens(path, size, prompts, mm_encoder_tp_mode=mode) == single, mode


@pytest.mark.slow
def test_qwen2_vl_matches_one_rank(tmp_path):
    """By default its parts run elsewhere: the float language model over 2 ranks in
    test_rank_zero_holds_its_share_and_matches_one_rank (data mode), the float tower sharded by weights mode in
    test_int4_by_whole_groups_matches_one_rank[weights]."""
    _parity(tmp_path, "qwen2_vl", modes=("weights",))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "fuyu"])
def test_family_matches_one_rank(tmp_path, family):
    _parity(tmp_path, family)


@pytest.mark.slow
def test_tied_embeddings_match_one_rank(tmp_path):
    _parity(tmp_path, "qwen2_vl", tie_word_embeddings=True)


@pytest.mark.slow
def test_four_ranks_replicate_kv_heads(tmp_path):
    """4 ranks, 2 KV heads: each KV head is kept by the two ranks whose query heads read it (the tower's 2 heads
    do not split over 4 ranks: data mode)."""
    _parity(tmp_path, "qwen2_vl", size=4, modes=("data",))


@pytest.mark.slow
def test_a_tower_the_ranks_cannot_split_is_a_config_error(tmp_path):
    path = build_qwen2_vl(tmp_path / "q")
    with pytest.raises(ConfigError, match="tensor_parallel_size 4 must divide the vision tower's 2 attention heads"):
        LLM(str(path), tensor_parallel_size=4, mm_encoder_tp_mode="weights", **OPTIONS)


@pytest.mark.slow
def test_preemption_and_samples_match_one_rank(tmp_path):
    """A KV cache too small for the batch preempts and recomputes requests: the workers' mirrored requests follow
    (sent whole again when they come back); n=2 samples of a seeded request match too."""
    path = build_qwen2_vl(tmp_path / "q")
    prompts = _prompts(QWEN, 2) + [f"prompt number {i} with some words" for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    params[1] = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=12, ignore_eos=True)
    results = []
    for size in (1, 2):
        with LLM(str(path), tensor_parallel_size=size, **{**OPTIONS, "kv_cache_tokens": 192}) as llm:
            outs = llm.generate(prompts, params)
            results.append([[c.token_ids for c in o.outputs] for o in outs])
            if size == 2:
                assert llm.engine.stats()["num_preemptions"] > 0
    assert results[0] == results[1]


@pytest.mark.slow
def test_triton_backend_on_each_rank_matches_one_rank(tmp_path):
    """The Triton attention kernels (Triton's interpreter on CPU) read each rank's head counts from its tensors;
    a small token budget adds chunked prefill mixed with decode."""
    pytest.importorskip("triton")
    path = build_qwen2_vl(tmp_path / "q")
    prompts, params = _prompts(QWEN, 1), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    single = _tokens(path, 1, prompts, params, attention_backend="reference")
    assert _tokens(path, 2, prompts, params, attention_backend="triton", kernel_backend="torch",
                   enforce_eager=True, max_num_batched_tokens=24) == single


def test_rank_zero_holds_its_share_and_matches_one_rank(tmp_path):
    """Rank 0's slice of the model, then the greedy tokens of one rank with the default (data) encoder mode."""
    path = build_qwen2_vl(tmp_path / "q")
    prompts = _prompts(QWEN, 2)
    single = _tokens(path, 1, prompts)
    with LLM(str(path), tensor_parallel_size=2, **OPTIONS) as llm:
        assert llm.engine.config.mm_encoder_tp_mode == "data"
        engine = llm.engine
        attn = engine.model.language_model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1, 2, 1)
        assert engine.runner.kv_caches[0].shape[3] == 1  # the KV cache holds this rank's one KV head
        # built with this rank's widths and loaded as slices: the full language model never existed here
        assert engine.model.language_model.cfg.num_attention_heads == 2
        assert engine.model.language_model.layers[0].mlp.gate_up_proj.weight.shape[0] == 128  # 2 x 128 / 2
        assert engine.model.lm_head.weight.shape[0] == engine.model.vocab_size // 2
        assert engine.model.language_model.embed_tokens.weight.shape[0] == engine.model.vocab_size // 2
        processes = engine.tp.processes
        assert len(processes) == 1 and processes[0].is_alive()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == single
    assert not processes[0].is_alive() and processes[0].exitcode == 0


def test_one_rank_runs_the_same_engine(tmp_path):
    path = build_qwen2_vl(tmp_path / "q")
    with LLM(str(path), tensor_parallel_size=1, **OPTIONS) as llm:
        assert llm.engine.tp.group.size == 1 and llm.engine.tp.processes == []
        assert llm.engine.model.language_model.layers[0].self_attn.num_heads == 4


def _fail_rank_1(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    import tp_faults

    from flashvlm.distributed import workers

    monkeypatch.setattr(workers, "worker_main", functools.partial(tp_faults.faulty_worker, where))


@pytest.mark.parametrize("where", ["step:2", "startup"])
def test_failing_rank_raises_and_leaves_no_process(tmp_path, monkeypatch, where):
    path = build_qwen2_vl(tmp_path / "q")
    _fail_rank_1(monkeypatch, where)
    prompts = _prompts(QWEN, 2)
    if where == "startup":
        with pytest.raises(TensorParallelError, match="rank 1 failed: RuntimeError: injected fault"):
            LLM(str(path), tensor_parallel_size=2, **OPTIONS)
        return
    llm = LLM(str(path), tensor_parallel_size=2, **OPTIONS)
    processes = llm.engine.tp.processes
    with pytest.raises(TensorParallelError, match="rank 1 failed: RuntimeError: injected fault"):
        llm.generate(prompts, GREEDY)
    assert not any(p.is_alive() for p in processes)
    with pytest.raises(TensorParallelError, match="stopped after an earlier failure"):
        llm.generate(prompts, GREEDY)
    llm.close()


def test_a_rank_failing_to_join_is_reported_and_the_next_engine_joins(tmp_path, monkeypatch):
    """Rank 0 waits in the rendezvous for a worker that died before joining: the worker's message, not the
    store's timeout; and the failed rendezvous leaves nothing behind that stops the next engine's group (torch's
    group counter)."""
    path = build_qwen2_vl(tmp_path / "q")
    prompts = _prompts(QWEN, 1)
    with monkeypatch.context() as patch:
        _fail_rank_1(patch, "join")
        with pytest.raises(TensorParallelError, match="rank 1 failed: RuntimeError: injected fault at join"):
            LLM(str(path), tensor_parallel_size=2, **{**OPTIONS, "distributed_timeout_s": 5})
    assert _tokens(path, 2, prompts) == _tokens(path, 1, prompts)


@pytest.mark.slow
def test_a_model_the_ranks_cannot_split_is_a_config_error(tmp_path):
    """4 attention heads over 3 ranks: rank 0's own error (every rank finds it), not a worker's report."""
    path = build_qwen2_vl(tmp_path / "q")
    with pytest.raises(ConfigError, match="tensor_parallel_size 3 must divide the model's 4 attention heads"):
        LLM(str(path), tensor_parallel_size=3, **OPTIONS)


@pytest.mark.slow
def test_hung_rank_times_out_with_a_clear_error(tmp_path, monkeypatch):
    path = build_qwen2_vl(tmp_path / "q")
    _fail_rank_1(monkeypatch, "hang-step:1")
    llm = LLM(str(path), tensor_parallel_size=2, **{**OPTIONS, "distributed_timeout_s": 10})
    processes = llm.engine.tp.processes
    with pytest.raises(TensorParallelError, match="collective failed"):
        llm.generate(_prompts(QWEN, 2), GREEDY)
    assert not any(p.is_alive() for p in processes)


@pytest.mark.slow
def test_idle_workers_outlive_the_collective_timeout(tmp_path):
    """Workers wait for the next step on a pipe, not in a collective: an engine idle for longer than
    distributed_timeout_s still steps."""
    path = build_qwen2_vl(tmp_path / "q")
    with LLM(str(path), tensor_parallel_size=2, **{**OPTIONS, "distributed_timeout_s": 10}) as llm:
        first = llm.generate("hello", GREEDY)[0].outputs[0].token_ids
        time.sleep(11)
        assert llm.generate("hello", GREEDY)[0].outputs[0].token_ids == first


# int8 with the quantized tower sharded by default. fp8 takes the same path (quant_shard.quantize_sharded), its
# row slices' rounding checked by test_row_parallel_slices_round_as_the_whole_row[fp8]; the rest are slow.
@pytest.mark.parametrize(("method", "mode"), [("int8", "weights"),
                                              pytest.param("int8", "data", marks=pytest.mark.slow),
                                              pytest.param("fp8", "data", marks=pytest.mark.slow),
                                              pytest.param("fp8", "weights", marks=pytest.mark.slow)])
def test_quantize_at_load_matches_one_rank(tmp_path, method, mode):
    path = build_qwen2_vl(tmp_path / "qwen2_vl")
    prompts = _prompts(QWEN, 2)
    single = _tokens(path, 1, prompts, quantization=method, quantize_vision=True)
    assert _tokens(path, 2, prompts, quantization=method, quantize_vision=True, mm_encoder_tp_mode=mode) == single


# int4 quantizes the language model only, whose sharding the encoder mode leaves alone: data mode is slow.
@pytest.mark.parametrize("mode", ["weights", pytest.param("data", marks=pytest.mark.slow)])
def test_int4_by_whole_groups_matches_one_rank(tmp_path, mode):
    # 256 wide: each rank's o_proj and down_proj inputs (128 and 256) are whole groups of 128.
    path = build_qwen2_vl(tmp_path / "qwen2_vl", hidden=256)
    prompts = _prompts(QWEN, 2)
    single = _tokens(path, 1, prompts, quantization="int4")
    assert single != _tokens(path, 1, prompts)
    assert _tokens(path, 2, prompts, quantization="int4", mm_encoder_tp_mode=mode) == single


def test_int4_slices_of_partial_groups_are_refused(tmp_path):
    path = build_qwen2_vl(tmp_path / "qwen2_vl")  # 64 wide: o_proj takes 32 inputs per rank
    with pytest.raises(ConfigError, match="self_attn.o_proj holds 32 inputs per rank, not a whole number of its "
                                          "groups of 128"):
        _tokens(path, 2, ["hello"], quantization="int4")


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_row_parallel_slices_round_as_the_whole_row(method):
    """Each rank's slice of a row-parallel weight rounds to the slice of the whole layer's rounding, with the
    whole row's scales (the ranks' row amax is their maximum: one rank holds each row's largest entry here)."""
    from flashvlm.distributed.quant_shard import _quantize_row_slice
    from flashvlm.layers.linear import Linear
    from flashvlm.quant.registry import get_method

    full = Linear(16, 6, bias=True)
    with torch.no_grad():
        full.weight.normal_()
        full.weight[:, 3] = 9.0  # rank 0's columns hold every row's amax: rank 1 must take it from the maximum
    m = get_method(method)
    whole = m.quantize(full, m.default_scheme())
    rank1 = RowParallelLinear(full, TPGroup(), 8, 16)
    sliced = _quantize_row_slice(rank1, m, m.default_scheme(), _MaxOf(full.weight[:, :8]))
    assert torch.equal(sliced.inner.weight.float()[:, :8], whole.weight[:, 8:].float())
    assert not sliced.inner.weight.float()[:, 8:].any()
    assert torch.equal(sliced.inner.weight_scale.view(-1), whole.weight_scale.view(-1))
    assert torch.equal(sliced.bias, full.bias)


class _MaxOf(TPGroup):
    """One rank of two whose other rank holds `other` (its columns of the weight): all_max sees both."""

    def __init__(self, other: torch.Tensor) -> None:
        super().__init__()
        self.other = other

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        return torch.maximum(x, self.other.abs().amax(dim=1, keepdim=True), out=x)


def test_quantization_and_both_encoder_modes_validate():
    for mode in ("data", "weights"):
        EngineConfig.from_options(None, device="cpu", tensor_parallel_size=2, mm_encoder_tp_mode=mode).validate()
    for method in ("int8", "fp8", "int4"):
        EngineConfig.from_options(None, device="cpu", tensor_parallel_size=2, quantization=method).validate()
    with pytest.raises(ConfigError, match="tensor_parallel_size must be >= 1"):
        EngineConfig.from_options(None, device="cpu", tensor_parallel_size=0).validate()
    EngineConfig.from_options(None, device="cpu", tensor_parallel_size=1, mm_encoder_tp_mode="weights").validate()


def test_head_split():
    def split(heads, kv, size):
        return [head_split(heads, kv, TPGroup(r, size)) for r in range(size)]

    assert split(4, 2, 2) == [(range(0, 2), range(0, 1)), (range(2, 4), range(1, 2))]
    # fewer KV heads than ranks: rank r keeps the KV head its query heads read
    assert [kv for _, kv in split(8, 2, 4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    with pytest.raises(ConfigError, match="attention heads"):
        head_split(6, 2, TPGroup(0, 4))
    with pytest.raises(ConfigError, match="KV heads"):
        head_split(12, 3, TPGroup(0, 2))


def test_image_shares_balance_tokens():
    items = [MMItem(mm_hash=str(i), pixel_values=None, num_tokens=n) for i, n in enumerate([10, 4, 4, 3])]
    assert shares(items, 2) == [[0], [1, 2, 3]]
    assert shares(items[:1], 2) == [[0], []]
