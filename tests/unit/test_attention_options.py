"""How EngineConfig resolves attention_backend and vision_attention: "auto" takes FlashAttention-4 only where it
runs, an explicit "fa4" that cannot run is a ConfigError naming why, and the engine hands the vision choice to
every layer of the tower."""

from __future__ import annotations

import pytest
import torch

from flashvlm.config import ConfigError, EngineConfig, ModelConfig
from flashvlm.kernels import dispatch


def _config(**kw) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="unused"), **kw)


def test_auto_on_cpu_takes_no_fa4() -> None:
    cfg = _config(device="cpu").validate()
    assert (cfg.attention_backend, cfg.vision_attention) == ("reference", "sdpa")


@pytest.mark.parametrize("field", ["attention_backend", "vision_attention"])
def test_explicit_fa4_where_it_cannot_run_names_the_reason(field: str) -> None:
    with pytest.raises(ConfigError, match=f"{field}='fa4': FlashAttention-4 needs a CUDA device"):
        _config(device="cpu", **{field: "fa4"}).validate()


@pytest.mark.parametrize("field,value", [("attention_backend", "flash"), ("vision_attention", "triton")])
def test_unknown_choices_are_refused(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=field):
        _config(device="cpu", **{field: value}).validate()


def test_auto_takes_fa4_where_it_runs(monkeypatch) -> None:
    """A CUDA device that FA4 serves: auto picks it for both; explicit choices stay as they are."""
    monkeypatch.setattr(dispatch, "fa4_unavailable_reason", lambda device: None)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "device_unavailable_reason", lambda device: None)  # a machine with the GPU
    cfg = _config(device="cuda").validate()
    assert (cfg.attention_backend, cfg.vision_attention) == ("fa4", "fa4")
    cfg = _config(device="cuda", attention_backend="triton", vision_attention="sdpa").validate()
    assert (cfg.attention_backend, cfg.vision_attention) == ("triton", "sdpa")


def test_auto_falls_back_where_fa4_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "fa4_unavailable_reason", lambda device: "not installed")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "device_unavailable_reason", lambda device: None)  # a machine with the GPU
    cfg = _config(device="cuda").validate()
    assert (cfg.attention_backend, cfg.vision_attention) == ("triton", "sdpa")


def test_unavailable_reason_on_this_machine() -> None:
    reason = dispatch.fa4_unavailable_reason("cpu")
    assert reason == "FlashAttention-4 needs a CUDA device"
    if not torch.cuda.is_available():
        assert dispatch.fa4_unavailable_reason("cuda") == reason


def test_set_vision_attention_reaches_every_tower_layer() -> None:
    from flashvlm.attention.vision import set_vision_attention
    from flashvlm.models.vision.qwen_vit import VisionAttention

    model = torch.nn.Sequential(VisionAttention(32, 4), torch.nn.Linear(2, 2), VisionAttention(32, 2))
    set_vision_attention(model, "fa4")
    assert [m.attention_impl for m in model if isinstance(m, VisionAttention)] == ["fa4", "fa4"]


@pytest.mark.parametrize("dtype,dim,takes", [(torch.bfloat16, 80, True), (torch.float16, 128, True),
                                             (torch.float32, 64, False), (torch.bfloat16, 12, False),
                                             (torch.bfloat16, 512, False)])
def test_fa4_takes_only_what_its_kernels_serve(monkeypatch, dtype: torch.dtype, dim: int, takes: bool) -> None:
    q = torch.zeros(3, 2, dim, dtype=dtype)
    assert not dispatch.fa4_takes(q)  # a CPU tensor never
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert dispatch.fa4_takes(q) is takes


def test_vision_fa4_on_tensors_it_does_not_take_is_sdpa() -> None:
    """impl="fa4" on CPU or float32 tensors runs torch's kernels: the same answer as impl="sdpa"."""
    from flashvlm.layers.vision_attention import varlen_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 40, 2, 16, generator=gen).unbind(0)
    cu = [0, 7, 7, 40]
    torch.testing.assert_close(varlen_attention(q, k, v, cu, impl="fa4"), varlen_attention(q, k, v, cu, impl="sdpa"),
                               rtol=0, atol=0)


def test_a_broken_flash_attn_package_reads_as_not_installed(monkeypatch) -> None:
    """find_spec imports the parent package; another release's flash_attn that fails to import must not stop
    the engine from starting (auto then falls back)."""
    import importlib.util

    def broken(name: str):
        raise ImportError("libcudart.so.11: cannot open shared object file")

    _hopper(monkeypatch)
    monkeypatch.setattr(importlib.util, "find_spec", broken)
    assert dispatch.fa4_unavailable_reason("cuda") == "FlashAttention-4 is not installed (pip install 'flashvlm[fa4]')"


def _hopper(monkeypatch, capability: tuple[int, int] = (9, 0)) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_found_but_not_importable_reads_as_unavailable(monkeypatch) -> None:
    """flash_attn is a namespace package: its module can be found while its compiler stack (cutlass-dsl for
    another CUDA, say) fails to import. That must read as unavailable, with the error, so auto falls back."""
    import importlib.util

    _hopper(monkeypatch)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(dispatch, "_fa4_import_error", lambda: "ModuleNotFoundError: No module named 'cutlass'")
    reason = dispatch.fa4_unavailable_reason("cuda")
    assert reason == ("FlashAttention-4 is installed but does not import "
                      "(ModuleNotFoundError: No module named 'cutlass')")
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "device_unavailable_reason", lambda device: None)  # a machine with the GPU
    cfg = _config(device="cuda").validate()
    assert (cfg.attention_backend, cfg.vision_attention) == ("triton", "sdpa")


def test_only_hopper_and_a_readable_device(monkeypatch) -> None:
    _hopper(monkeypatch, (10, 0))
    assert "sm_90" in dispatch.fa4_unavailable_reason("cuda") and "sm_100" in dispatch.fa4_unavailable_reason("cuda")

    def no_such_device(device=None):
        raise AssertionError("Invalid device id")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_such_device)
    assert dispatch.fa4_unavailable_reason("cuda:7").startswith("cannot read the capability of cuda:7")


def test_reference_backend_keeps_the_tower_on_sdpa(monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "fa4_unavailable_reason", lambda device: None)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "device_unavailable_reason", lambda device: None)  # a machine with the GPU
    cfg = _config(device="cuda", attention_backend="reference").validate()
    assert (cfg.attention_backend, cfg.vision_attention) == ("reference", "sdpa")


def test_fa4_needs_triton_for_decode(monkeypatch) -> None:
    monkeypatch.setattr(dispatch, "fa4_unavailable_reason", lambda device: None)
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    monkeypatch.setattr(dispatch, "device_unavailable_reason", lambda device: None)  # a machine with the GPU
    with pytest.raises(ConfigError, match="install Triton"):
        _config(device="cuda", attention_backend="fa4").validate()


def test_float32_models_leave_fa4(monkeypatch) -> None:
    """The model's dtype is known only once the checkpoint is read: the engine then runs a float32 model off FA4
    (which takes bf16/fp16) and records that in its limits (the benchmark fingerprint's `limits`); the config
    keeps what was asked for."""
    monkeypatch.setattr(dispatch, "fa4_unavailable_reason", lambda device: None)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setattr(dispatch, "device_unavailable_reason", lambda device: None)  # a machine with the GPU
    cfg = _config(device="cuda").validate()
    assert cfg.attention_for_dtype(torch.bfloat16) == ("fa4", "fa4")
    assert cfg.attention_for_dtype(torch.float32) == ("triton", "sdpa")
    assert (cfg.attention_backend, cfg.vision_attention) == ("fa4", "fa4")


def test_option_choices_are_the_registered_backends() -> None:
    """The config's choices and the backend registries name the same backends: a backend registered in one and
    not the other would be unreachable or fail at start-up."""
    from flashvlm.attention.base import ATTENTION_BACKENDS
    from flashvlm.attention.vision import VISION_BACKENDS
    from flashvlm.config import engine_options

    choices = {o.name: o.spec.choices for o in engine_options()}
    assert tuple(choices["attention_backend"]) == ("auto", *ATTENTION_BACKENDS)
    assert tuple(choices["vision_attention"]) == ("auto", *VISION_BACKENDS)
