"""The kv_cache_dtype option: its values and the e5m2 refusal (config and CLI), FA4 leaving an FP8 cache to the Triton
kernel, the GPUs our e4m3 kernels need, the checkpoint's kv_cache_scheme, and the layers' unset scales."""

from __future__ import annotations

import types

import pytest
import torch

from flashvlm.attention.kv_quant import FP8_KV_DTYPE, kv_cache_torch_dtype
from flashvlm.attention.reference import ReferenceBackend
from flashvlm.cli import build_parser
from flashvlm.config import ConfigError, EngineConfig, ModelConfig
from flashvlm.kernels import dispatch
from flashvlm.layers.attention import ForwardContext, PagedAttention
from flashvlm.models.interfaces import KVCacheSpec
from flashvlm.runner.inputs import single_sequence_context
from flashvlm.runner.kv_scales import checkpoint_kv_scheme


def _config(**cache_and_top) -> EngineConfig:
    return EngineConfig.from_options("unused", **cache_and_top)


@pytest.mark.parametrize("value,dtype", [("auto", torch.bfloat16), ("fp8", FP8_KV_DTYPE), ("fp8_e4m3", FP8_KV_DTYPE)])
def test_values(value: str, dtype: torch.dtype) -> None:
    cfg = _config(device="cpu", kv_cache_dtype=value).validate()
    assert cfg.cache.kv_cache_dtype == value
    assert kv_cache_torch_dtype(value, torch.bfloat16) == dtype


def test_e5m2_is_refused_with_the_reason() -> None:
    with pytest.raises(ConfigError, match="'fp8_e5m2' is not supported: an e5m2 KV cache at default scaling silently "
                                          "corrupts Qwen2-VL output.*use kv_cache_dtype 'fp8'"):
        _config(device="cpu", kv_cache_dtype="fp8_e5m2").validate()
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto, fp8 or fp8_e4m3, got 'int8'"):
        _config(device="cpu", kv_cache_dtype="int8").validate()
    with pytest.raises(ValueError, match="e4m3 with per-layer K and V scales"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16)


def test_the_flag_refuses_e5m2_with_the_reason(capsys) -> None:
    parser = build_parser()
    assert parser.parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--kv-cache-dtype", "fp8_e5m2"])
    assert "silently corrupts Qwen2-VL output" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--kv-cache-dtype", "fp16"])
    assert "kv_cache_dtype must be auto, fp8 or fp8_e4m3, got 'fp16'" in capsys.readouterr().err


def _hopper_with_fa4(monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "fa4_unavailable_reason", lambda device: None)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def test_fa4_leaves_an_fp8_cache_to_the_triton_kernel(monkeypatch) -> None:
    """FA4 reads bf16/fp16 paged caches only: with an FP8 cache the LM's attention runs our Triton kernels (decided
    once, at start-up, into EngineLimits); the vision tower, which has no KV cache, keeps FA4."""
    _hopper_with_fa4(monkeypatch)
    cfg = _config(device="cuda", kv_cache_dtype="fp8").validate()
    assert (cfg.attention_backend, cfg.vision_attention) == ("fa4", "fa4")  # the config keeps what was asked for
    assert cfg.attention_for_dtype(torch.bfloat16) == ("triton", "fa4")
    assert cfg.attention_for_dtype(torch.float32) == ("triton", "sdpa")
    assert _config(device="cuda").validate().attention_for_dtype(torch.bfloat16) == ("fa4", "fa4")
    explicit = _config(device="cuda", kv_cache_dtype="fp8", attention_backend="fa4").validate()
    assert explicit.attention_for_dtype(torch.float16) == ("triton", "fa4")


def test_gpus_before_sm89_cannot_run_the_e4m3_kernels(monkeypatch) -> None:
    _hopper_with_fa4(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ConfigError, match="kv_cache_dtype='fp8' with the fa4 attention backend: Triton's e4m3 "
                                          "conversions need an sm_89 or newer GPU, not sm_80"):
        _config(device="cuda", kv_cache_dtype="fp8").validate()
    cfg = _config(device="cuda", kv_cache_dtype="fp8", attention_backend="reference").validate()
    assert cfg.attention_backend == "reference"  # plain torch casts run anywhere
    assert _config(device="cuda").validate().attention_backend == "fa4"


@pytest.mark.parametrize("quantization_config,expected", [
    (None, None),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, None),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}},
     "scheme"),
    ({"kv_cache_scheme": {"type": "float", "strategy": None}}, "scheme"),  # QuantizationArgs' defaults fill the rest
])
def test_the_checkpoint_scheme(quantization_config, expected) -> None:
    hf_config = types.SimpleNamespace(quantization_config=quantization_config)
    found = checkpoint_kv_scheme(hf_config)
    assert (found is None) == (expected is None)
    if expected is not None:
        assert found == quantization_config["kv_cache_scheme"]


def test_a_scheme_we_cannot_run_is_named() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_scheme \(num_bits=4, type='int'\) is not one flashvlm runs"):
        checkpoint_kv_scheme(types.SimpleNamespace(quantization_config={"kv_cache_scheme": {"num_bits": 4}}))
    quant = types.SimpleNamespace(to_dict=lambda: {"kv_cache_scheme": {"type": "float", "strategy": "channel"}})
    with pytest.raises(ConfigError, match=r"\(strategy='channel'\)"):
        checkpoint_kv_scheme(types.SimpleNamespace(quantization_config=quant))


def test_scales_nobody_set_read_as_nan_never_as_one() -> None:
    """A layer's scales start as NaN: an FP8 cache read before the checkpoint or the calibration set them gives NaN,
    not the answer of a silent 1.0; a cache in the model's dtype never reads them."""
    torch.manual_seed(0)
    layer = PagedAttention(num_heads=4, num_kv_heads=2, head_dim=16, layer_idx=0)
    assert torch.isnan(layer.k_scale).all() and torch.isnan(layer.v_scale).all()
    assert layer.k_scale.dtype == torch.float32 and "k_scale" not in layer.state_dict()
    q, k, v = torch.randn(5, 64), torch.randn(5, 32), torch.randn(5, 32)
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16)
    outs = {}
    for dtype in (torch.float32, FP8_KV_DTYPE):
        ctx = single_sequence_context(5, spec, dtype, "cpu", 16, ReferenceBackend())
        outs[dtype] = layer(q, k, v, ForwardContext(ctx.attn_meta, ctx.kv_caches, ctx.backend))
    assert torch.isfinite(outs[torch.float32]).all()
    assert torch.isnan(outs[FP8_KV_DTYPE]).all()
    layer.k_scale.fill_(0.01)
    layer.v_scale.fill_(0.01)
    ctx = single_sequence_context(5, spec, FP8_KV_DTYPE, "cpu", 16, ReferenceBackend())
    out = layer(q, k, v, ctx)
    torch.testing.assert_close(out, outs[torch.float32], rtol=0.1, atol=0.1)


def test_config_without_options_keeps_the_model_dtype() -> None:
    assert EngineConfig(model=ModelConfig(model="x")).cache.kv_cache_dtype == "auto"
