"""kv_cache_dtype fp8 through the whole engine on tiny Qwen2-VL checkpoints (CPU): the greedy answer and logits
against a plain-torch reference of the same quantized cache, the KV budget doubling at the same memory, and the
per-layer scales read from a compressed-tensors checkpoint's kv_cache_scheme (as llm-compressor writes it)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from flashvlm import LLM, SamplingParams
from flashvlm.attention.kv_quant import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from flashvlm.attention.reference import ReferenceBackend
from flashvlm.bench.scenarios import engine_config_dict
from flashvlm.config import ConfigError
from flashvlm.runner.kv_scales import attention_layers
from flashvlm.testing.tiny_checkpoints import build_llava, build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
             "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
             "observer_kwargs": {}}
"""A kv_cache_scheme as llm-compressor saves it for its FP8 KV recipe (num_bits 8, float, tensor, static)."""


class FakeQuantizedCache(ReferenceBackend):
    """The reference of an FP8 cache in plain torch: a float32 cache holding dequantize(quantize(x)), with the same
    per-layer scales, read as it is."""

    def write_kv(self, k, v, kv_cache, meta, k_scale=None, v_scale=None) -> None:
        k = dequantize_kv(quantize_kv(k, k_scale), k_scale, torch.float32)
        v = dequantize_kv(quantize_kv(v, v_scale), v_scale, torch.float32)
        super().write_kv(k, v, kv_cache, meta)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen"), seed=21)


def _prompts() -> list:
    rng = np.random.default_rng(4)
    return [{"prompt": IMG + "Describe the picture in a few words.",
             "images": [rng.integers(0, 256, (56, 84, 3), np.uint8)]},
            {"prompt": "A text-only question, somewhat longer than the other prompt, to decode after?"}]


def _greedy_with_logits(llm: LLM) -> tuple[list[list[int]], list[torch.Tensor]]:
    llm.engine.runner.record_logits = True
    outs = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    logits = [torch.stack(llm.engine.runner.recorded_logits[o.request_id]) for o in outs]
    return [o.token_ids for o in outs], logits


def _copy_scales(source: LLM, target: LLM) -> None:
    for a, b in zip(attention_layers(source.engine.model), attention_layers(target.engine.model)):
        b.k_scale.copy_(a.k_scale)
        b.v_scale.copy_(a.v_scale)


def _agreeing_steps(a: list[int], b: list[int]) -> int:
    """Steps whose context two greedy answers share: up to and including their first different token."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def test_fp8_cache_gives_the_fake_quantized_reference(ckpt: Path) -> None:
    """A float32 model with an e4m3 cache: the same greedy tokens and (to float32 rounding) logits as the model
    reading a float32 cache that holds the quantize-dequantize of the same keys and values with the same scales.

    Against the unquantized cache, at every step whose context both answers share, the logits move (the cache really
    is FP8) by at most 4% of their spread. e4m3 rounds each stored element by up to 2^-4 of itself and the errors
    partly average out in attention; on this tiny random model they moved 1.2-1.9% of the spread, so 4% leaves
    twice that. (Its near-tied logits may flip a greedy token later on: the answers are not compared.)"""
    # No prefix caching: the reference engine runs the prompts twice, and must recompute their KV the second time.
    common = dict(device="cpu", dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=24,
                  enable_prefix_caching=False)
    fp8 = LLM(str(ckpt), kv_cache_dtype="fp8", **common)
    assert fp8.engine.runner.kv_caches[0].dtype == FP8_KV_DTYPE
    assert fp8.engine.limits.kv_scale_source == "calibrated"
    tokens, logits = _greedy_with_logits(fp8)
    reference = LLM(str(ckpt), **common)
    plain_tokens, plain_logits = _greedy_with_logits(reference)
    reference.engine.runner.executor.backend = FakeQuantizedCache()
    _copy_scales(fp8, reference)
    reference.engine.runner.recorded_logits.clear()
    ref_tokens, ref_logits = _greedy_with_logits(reference)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for answer, plain_answer, got, plain in zip(tokens, plain_tokens, logits, plain_logits):
        shared = _agreeing_steps(answer, plain_answer)
        moved = (got[:shared] - plain[:shared]).abs().amax(1)
        spread = plain[:shared].amax(1) - plain[:shared].amin(1)
        assert (moved > 0).all() and (moved <= 0.04 * spread).all(), (moved / spread).tolist()


@pytest.mark.slow  # the Triton kernels run in the interpreter on CPU
def test_triton_backend_reads_the_fp8_cache_as_the_reference_backend(ckpt: Path) -> None:
    """Chunked prefill (chunks after a cached prefix, mixed with decode tokens) and decode through kv_write,
    paged_prefill and paged_decode on an e4m3 cache, against the reference backend on the same scales: the same
    tokens, logits within 2e-3. Not to float32 rounding: the two backends sum in different orders, and a difference
    of 1e-6 in a layer's output can put a key on the other side of an e4m3 rounding boundary, a whole e4m3 step
    (2^-4 of it) away; on this model that moved logits by up to 4e-4, against 0.06 between the FP8 and a float32
    cache."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    common = dict(device=device, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=24,
                  kernel_backend="torch", enforce_eager=True, kv_cache_dtype="fp8")
    outs = {}
    engines = {}
    for backend in ("reference", "triton"):
        engines[backend] = LLM(str(ckpt), attention_backend=backend, **common)
        if backend == "triton":
            _copy_scales(engines["reference"], engines["triton"])
        outs[backend] = _greedy_with_logits(engines[backend])
    assert outs["triton"][0] == outs["reference"][0]
    for got, want in zip(outs["triton"][1], outs["reference"][1]):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)


def test_the_kv_budget_doubles_at_the_same_memory(ckpt: Path) -> None:
    """A bf16 model: its FP8 cache has twice the blocks in exactly the bytes of the bf16 cache (the CPU engine's
    budget is the memory of 8 max_model_len sequences in the model's dtype)."""
    llms = {kv: LLM(str(ckpt), device="cpu", dtype="bfloat16", max_model_len=512, kv_cache_dtype=kv)
            for kv in ("auto", "fp8")}
    engines = {kv: llm.engine for kv, llm in llms.items()}
    auto, fp8 = engines["auto"], engines["fp8"]
    assert fp8.limits.num_kv_blocks == 2 * auto.limits.num_kv_blocks
    assert fp8.scheduler.block_manager.num_blocks == fp8.limits.num_kv_blocks
    nbytes = {kv: sum(t.numel() * t.element_size() for t in e.runner.kv_caches) for kv, e in engines.items()}
    assert nbytes["fp8"] == nbytes["auto"]
    assert (auto.limits.kv_cache_dtype, auto.limits.kv_scale_source) == ("bfloat16", "none")
    assert (fp8.limits.kv_cache_dtype, fp8.limits.kv_scale_source) == ("float8_e4m3fn", "calibrated")
    recorded = engine_config_dict(llms["fp8"])  # the engine config results.json records
    assert recorded["cache"]["kv_cache_dtype"] == "fp8"
    assert (recorded["limits"]["kv_cache_dtype"], recorded["limits"]["kv_scale_source"]) == ("float8_e4m3fn",
                                                                                             "calibrated")


# ---------------------------------------------------------------- scales from the checkpoint

def with_kv_scales(path: Path, scales: dict[int, tuple[float, float]] | None, scheme: dict | None = KV_SCHEME,
                   zero_points: bool = True) -> Path:
    """The tiny checkpoint at `path` made into an FP8-KV one as compressed-tensors saves it: each listed layer's
    attention module gets k_scale and v_scale tensors of shape (1,) in the weights' dtype (and zero k/v zero points),
    and config.json a quantization_config carrying the kv_cache_scheme."""
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    key_weights = sorted(n for n in tensors if n.endswith(".self_attn.k_proj.weight") and "vis" not in n)
    for name in key_weights:
        layer = int(name.split(".layers.")[1].split(".")[0])
        if scales is None or layer not in scales:
            continue
        prefix = name.removesuffix("k_proj.weight")
        dtype = tensors[name].dtype
        for kind, value in zip("kv", scales[layer]):
            tensors[f"{prefix}{kind}_scale"] = torch.tensor([value], dtype=dtype)
            if zero_points:
                tensors[f"{prefix}{kind}_zero_point"] = torch.zeros(1, dtype=FP8_KV_DTYPE)
    save_file(tensors, weights, metadata={"format": "pt"})
    if scheme is not None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                         "ignore": [], "kv_cache_scheme": scheme, "quantization_status": "compressed"}
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_scales_come_from_the_checkpoint(tmp_path: Path, caplog, family: str) -> None:
    """Each decoder layer's scales reach its attention layer, under either family's checkpoint names (Qwen2-VL's
    model.layers.N.self_attn.*, llava-hf's language_model.model.layers.N.self_attn.*), with no warning about
    tensors left unloaded; the vision towers have no KV cache and get none."""
    build = build_qwen2_vl if family == "qwen2_vl" else build_llava
    path = with_kv_scales(build(tmp_path / "m", seed=2), {0: (0.0123, 0.25), 1: (0.07, 0.0031)})
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(path), device="cpu", kv_cache_tokens=512, kv_cache_dtype="fp8")
    assert not [r for r in caplog.records if "not loaded" in r.getMessage()], "the scales were warned about"
    assert llm.engine.limits.kv_scale_source == "checkpoint"
    layers = attention_layers(llm.engine.model)
    got = [value for m in layers for value in (m.k_scale.item(), m.v_scale.item())]
    assert got == pytest.approx([0.0123, 0.25, 0.07, 0.0031], rel=1e-6)  # stored in the checkpoint's float32
    assert all(m.k_scale.dtype == torch.float32 for m in layers)
    out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    # The same checkpoint with the model-dtype cache loads too, its scales unused.
    auto = LLM(str(path), device="cpu", kv_cache_tokens=512)
    assert (auto.engine.limits.kv_cache_dtype, auto.engine.limits.kv_scale_source) == ("float32", "none")


def test_scales_without_a_scheme_are_still_the_checkpoints(tmp_path: Path) -> None:
    path = with_kv_scales(build_qwen2_vl(tmp_path / "m", seed=2), {0: (0.5, 0.5), 1: (0.25, 0.125)}, scheme=None,
                          zero_points=False)
    llm = LLM(str(path), device="cpu", kv_cache_tokens=512, kv_cache_dtype="fp8")
    assert llm.engine.limits.kv_scale_source == "checkpoint"
    assert [m.v_scale.item() for m in attention_layers(llm.engine.model)] == [0.5, 0.125]


@pytest.mark.parametrize("scales,scheme,message", [
    ({0: (0.1, 0.1)}, KV_SCHEME, r"k_scale / v_scale for layer\(s\) \[1\] although its kv_cache_scheme declares"),
    (None, KV_SCHEME, r"lacks self_attn.k_scale / v_scale for layer\(s\) \[0, 1\]"),
    ({0: (0.1, 0.1)}, None, r"lacks self_attn.k_scale / v_scale for layer\(s\) \[1\]$"),
    ({0: (0.1, -0.1), 1: (0.1, 0.1)}, KV_SCHEME, "layer 0's checkpoint KV scales must be positive"),
    (None, {**KV_SCHEME, "strategy": "attn_head"}, r"kv_cache_scheme \(strategy='attn_head'\) is not one"),
    (None, {**KV_SCHEME, "type": "int"}, r"kv_cache_scheme \(type='int'\)"),
    (None, {**KV_SCHEME, "dynamic": True, "symmetric": False}, r"\(dynamic=True, symmetric=False\)"),
], ids=["a-layer-missing", "none-despite-the-scheme", "partial-without-scheme", "negative", "per-head", "int8",
        "dynamic-asymmetric"])
def test_checkpoint_scales_we_cannot_use_are_refused(tmp_path: Path, scales, scheme, message) -> None:
    path = with_kv_scales(build_qwen2_vl(tmp_path / "m", seed=2), scales, scheme=scheme)
    with pytest.raises(ConfigError, match=message):
        LLM(str(path), device="cpu", kv_cache_tokens=512, kv_cache_dtype="fp8")


def test_per_head_scale_tensors_are_named_and_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Undeclared per-head K scales: a model-dtype cache loads the checkpoint as before, an FP8 cache calibrates its
    own scales; both name the tensor they leave unused."""
    path = build_qwen2_vl(tmp_path / "m", seed=2)
    tensors = load_file(path / "model.safetensors")
    name = next(n for n in tensors if n.endswith("layers.0.self_attn.k_proj.weight"))
    tensors[name.replace("k_proj.weight", "k_scale")] = torch.ones(2, 1, 1)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    for kv_cache_dtype, source in (("auto", "none"), ("fp8", "calibrated")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flashvlm.models.weight_utils"):
            llm = LLM(str(path), device="cpu", kv_cache_tokens=512, kv_cache_dtype=kv_cache_dtype)
        assert llm.engine.limits.kv_scale_source == source
        assert "k_scale has shape (2, 1, 1): flashvlm reads one K and one V scale per layer" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and FlashAttention-4 need a GPU")
def test_on_a_gpu_graphs_read_the_scales_and_fa4_falls_back() -> None:
    """The trained demo model in bf16 with an FP8 cache: FA4 (where it runs) leaves the LM's attention to the Triton
    backend at start-up while the tower keeps its choice; decode and step graphs, which read the layers' scales by
    address, give the eager engine's tokens; and the answers start as the reference backend's on the same scales."""
    from flashvlm.models.default import default_model_path

    rng = np.random.default_rng(0)
    prompts = [{"prompt": IMG * (k % 2) + f"question {k} " * (k + 1),
                "images": [rng.integers(0, 256, (112, 84, 3), dtype=np.uint8)] * (k % 2)} for k in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(device="cuda", dtype="bfloat16", kv_cache_tokens=8192, max_num_seqs=8, max_num_batched_tokens=256,
                  kv_cache_dtype="fp8")
    answers, engines = {}, {}
    for name, kw in {"graphs": {}, "eager": dict(enforce_eager=True),
                     "reference": dict(attention_backend="reference", enforce_eager=True)}.items():
        llm = LLM(str(default_model_path()), **common, **kw)
        engines[name] = llm
        if name != "reference":
            assert llm.engine.limits.attention_backend == "triton"
            assert llm.engine.limits.vision_attention == llm.engine.config.vision_attention
        else:
            _copy_scales(engines["graphs"], llm)
        assert llm.engine.limits.kv_scale_source == "calibrated"
        answers[name] = [o.token_ids for o in llm.generate(prompts, params)]
    assert engines["graphs"].engine.runner.graphs is not None
    assert answers["graphs"] == answers["eager"]
    assert [a[:8] for a in answers["eager"]] == [a[:8] for a in answers["reference"]]


def test_a_kv_scheme_we_cannot_run_only_stops_an_fp8_cache(tmp_path: Path) -> None:
    """A checkpoint whose kv_cache_scheme is per channel loads with a cache in the model dtype (its KV scales are
    not read) and is refused, naming the scheme, when the cache is FP8."""
    path = build_qwen2_vl(tmp_path / "m", seed=2)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {},
                                     "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                         "dynamic": False, "symmetric": True}}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), device="cpu", kv_cache_tokens=512)
    assert llm.engine.limits.kv_scale_source == "none" and llm.engine.limits.quantization is None
    with pytest.raises(ConfigError, match=r"kv_cache_scheme \(strategy='channel'\) is not one flashvlm runs"):
        LLM(str(path), device="cpu", kv_cache_tokens=512, kv_cache_dtype="fp8")
