"""The decode GEMV (kernels/gemv.py) against torch's linear, and the layers that dispatch to it.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter in float32; with CUDA the compiled
kernel runs in bfloat16 and float16 against a float32 product of the same (rounded) inputs.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

pytest.importorskip("triton")

from flashvlm.kernels import dispatch  # noqa: E402
from flashvlm.kernels import gemv as gemv_mod  # noqa: E402
from flashvlm.kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv_config,
    gemv_lock_count,
    gemv_reference,
    gemv_triton,
    with_gemv_tiles,
)
from flashvlm.layers.activation import silu_and_mul_reference  # noqa: E402
from flashvlm.layers.linear import (  # noqa: E402
    Linear,
    MergedLinear,
    gemv_applies,
    linear,
    set_gemv_max_rows,
)
from flashvlm.layers.mlp import GatedMLP  # noqa: E402

INTERPRETED = type(gemv_mod._gemv_kernel).__name__ == "InterpretedFunction"
_CPU_OK = INTERPRETED and dispatch.interpreter_active()
_CUDA_OK = torch.cuda.is_available() and not INTERPRETED
CASES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1"),
                 id="cpu-fp32"),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.skipif(not _CUDA_OK, reason="no CUDA"), id="cuda-bf16"),
    pytest.param("cuda", torch.float16, marks=pytest.mark.skipif(not _CUDA_OK, reason="no CUDA"), id="cuda-fp16"),
]
# (rows, N, K): K not a multiple of the K block, N not a multiple of the column block, and exact fits.
SHAPES = [(1, 40, 96), (2, 100, 200), (3, 64, 512), (7, 24, 1000), (16, 257, 768)]
CONFIGS = [None, GemvConfig(16, 32), GemvConfig(32, 64, split_k=3), GemvConfig(16, 32, split_k=8, num_stages=2)]


def _inputs(device, dtype, rows, n, k, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    return x, w, b


def _expected(x, w, b):
    """The float32 product of the kernel's (rounded) inputs."""
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("config", CONFIGS, ids=["default", "no-split", "split3", "split8"])
@pytest.mark.slow
def test_gemv_matches_linear(device, dtype, rows, n, k, bias, config):
    x, w, b = _inputs(device, dtype, rows, n, k, bias, seed=rows * 1000 + n + k)
    locks = torch.zeros(gemv_lock_count(n, config or gemv_config(n, k)), dtype=torch.int32, device=device)
    out = gemv_triton(x, w, b, config=config, locks=locks)
    assert not locks.any()  # the last program of each column block reset its counter
    again = gemv_triton(x, w, b, config=config, locks=locks)
    assert torch.equal(out, again)  # the counters were reusable, and the split sums in a fixed order
    assert out.shape == (rows, n) and out.dtype == dtype
    expected = _expected(x, w, b)
    # float32: summation order only. Half precision: one rounding of the output (and of fp32 partial sums).
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
    if dtype != torch.float32:  # and no worse than torch's own half-precision linear
        err = (out.float() - expected).abs().max()
        torch_err = (gemv_reference(x, w, b).float() - expected).abs().max()
        assert err <= 2 * torch_err + 1e-3


@pytest.mark.parametrize("device,dtype", CASES[:2])
def test_gemv_rejects_bad_shapes(device, dtype):
    x, w, _ = _inputs(device, dtype, 2, 16, 32, False, 0)
    with pytest.raises(ValueError, match="columns"):
        gemv_triton(x[:, :31], w)
    with pytest.raises(ValueError, match="rows"):
        gemv_triton(torch.cat([x] * 9), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv_triton(x, w.t().contiguous().t())
    with pytest.raises(ValueError, match="locks"):
        gemv_triton(x, w, config=GemvConfig(16, 16, split_k=2), locks=torch.zeros(1, device=device))


def test_gemv_config_at_measured_shapes():
    """The measured choices: wide matrices never split; narrow ones with few column blocks split K in two."""
    assert gemv_config(37888, 3584).split_k == gemv_config(152064, 3584).split_k == 1
    assert gemv_config(3584, 3584).split_k == 2
    assert gemv_config(4608, 3584).split_k == 1
    assert gemv_config(3584, 18944).split_k == 2
    assert gemv_config(4096, 12288).split_k == gemv_config(4096, 4096).split_k == 2  # Qwen3-8B, Mistral-7B
    assert gemv_config(12288, 4096).split_k == 1  # Persimmon's QKV: 192 column blocks
    assert gemv_config(64, 64).split_k == 1  # too short to split


def test_dispatch_policy():
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    assert not gemv_applies(x, w, max_rows=4)  # CPU tensors take torch unless forced
    assert not gemv_applies(torch.randn(5, 16, dtype=torch.bfloat16), w, max_rows=4, force=True)
    assert not gemv_applies(x, w, max_rows=0, force=True)
    assert not gemv_applies(x, w.t().contiguous().t(), max_rows=4, force=True)
    assert not gemv_applies(x.unsqueeze(0), w, max_rows=4, force=True)
    if _CPU_OK:
        assert gemv_applies(x, w, max_rows=4, force=True)


@pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1")
def test_layers_route_few_rows_through_the_gemv(monkeypatch):
    """Linear, MergedLinear and GatedMLP give F.linear's answer through the GEMV for few rows, and never call it for
    more rows, with the GEMV off, or with the layer's kernels off."""
    calls = []
    real = gemv_mod.gemv_triton

    def spy(x, weight, *args, **kwargs):
        calls.append(tuple(weight.shape))
        return real(x, weight, *args, **kwargs)

    monkeypatch.setattr(gemv_mod, "gemv_triton", spy)
    monkeypatch.setattr("flashvlm.layers.linear.use_triton", lambda x, enabled=None, force=False: enabled is not False)
    monkeypatch.setattr("flashvlm.layers.linear._GEMV_DTYPES", (torch.float32,))
    torch.manual_seed(0)
    mlp = GatedMLP(24, 40, "silu", bias=False)
    merged = MergedLinear(24, [8, 16], bias=True)
    for rows, expect_calls in ((3, [(80, 24), (24, 40), (24, 24)]), (17, [])):
        calls.clear()
        x = torch.randn(rows, 24)
        gate_up = torch.nn.functional.linear(x, mlp.gate_up_proj.weight)
        expected = torch.nn.functional.linear(silu_and_mul_reference(gate_up), mlp.down_proj.weight)
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(x), torch.nn.functional.linear(x, merged.weight, merged.bias))
        assert calls == expect_calls
    set_gemv_max_rows(mlp, 0)
    calls.clear()
    mlp(torch.randn(2, 24))
    assert calls == []
    head = Linear(24, 10, bias=False)
    head.use_triton_kernels = False
    head(torch.randn(1, 24))
    assert calls == []
    assert linear(torch.randn(1, 24), head.weight, enabled=False).shape == (1, 10)


@pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1")
def test_layer_split_k_uses_and_resets_its_own_counters(monkeypatch):
    """A narrow Linear with a long K splits; the layer hands the kernel its own counters, which end at zero.
    set_gemv_max_rows zeroes counters that start dirty (a model materialised from meta, say)."""
    monkeypatch.setattr("flashvlm.layers.linear.use_triton", lambda x, enabled=None, force=False: enabled is not False)
    monkeypatch.setattr("flashvlm.layers.linear._GEMV_DTYPES", (torch.float32,))
    seen = []
    real = gemv_mod.gemv_triton
    monkeypatch.setattr(gemv_mod, "gemv_triton", lambda *a, **kw: seen.append(kw["locks"]) or real(*a, **kw))
    torch.manual_seed(0)
    layer = Linear(1024, 64, bias=True)
    assert gemv_config(64, 1024).split_k == 2
    layer.gemv_locks.fill_(7)
    set_gemv_max_rows(layer, 16)
    assert not layer.gemv_locks.any()
    x = torch.randn(2, 1024)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
    assert seen and seen[0] is layer.gemv_locks and not layer.gemv_locks.any()


@pytest.mark.skipif(not _CPU_OK, reason="needs TRITON_INTERPRET=1")
def test_tied_head_and_engine_switch(monkeypatch, tmp_path):
    """A tied LM head (no lm_head module) takes the GEMV for few rows too; decode_gemv=False reaches every layer."""
    from flashvlm import LLM
    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

    path = build_qwen2_vl(tmp_path / "tied", tie_word_embeddings=True)
    llm = LLM(str(path), decode_gemv=False)
    model = llm.engine.model
    assert model.lm_head is None
    assert all(m.gemv_max_rows == 0 for m in model.modules() if hasattr(m, "gemv_max_rows"))
    calls = []
    monkeypatch.setattr("flashvlm.layers.linear.use_triton", lambda x, enabled=None, force=False: enabled is not False)
    monkeypatch.setattr("flashvlm.layers.linear._GEMV_DTYPES", (torch.float32,))
    monkeypatch.setattr(gemv_mod, "gemv_triton", lambda x, w, *a, **kw: calls.append(w.shape) or x @ w.t())
    hidden = torch.randn(3, model.language_model.embed_tokens.embedding_dim)
    model.compute_logits(hidden)
    assert calls == []  # switched off
    set_gemv_max_rows(model, 16)
    logits = model.compute_logits(hidden)
    assert calls == [model.language_model.embed_tokens.weight.shape]
    torch.testing.assert_close(logits, hidden @ model.language_model.embed_tokens.weight.t())


def test_variant_configs_put_the_tile_fields_first() -> None:
    from flashvlm.kernels.fp8_gemv import Fp8GemvConfig
    from flashvlm.kernels.int8_gemv import Int8GemvConfig

    assert Fp8GemvConfig._fields == GemvConfig._fields + ("dot", "fuse_max_rows", "round_bits")
    assert tuple(Fp8GemvConfig(32, 64)) == (32, 64, 1, 4, 3, "fp8", 0, None)
    assert Fp8GemvConfig(16, 32, 2, 8, 2, "f16")._replace(round_bits=True).round_bits is True
    assert tuple(Int8GemvConfig(64, 256, 2)) == (64, 256, 2, 4, 4, 0)
    cfg = Int8GemvConfig(16, 32, fuse_max_rows=16)
    assert Int8GemvConfig(*list(cfg)) == cfg and cfg.block_k == 32
    assert repr(cfg) == "Int8GemvConfig(block_n=16, block_k=32, split_k=1, num_warps=4, num_stages=4, fuse_max_rows=16)"

    class NoDefault(NamedTuple):
        mode: int

    with pytest.raises(TypeError, match="NoDefault: every option needs a default"):
        with_gemv_tiles()(NoDefault)
