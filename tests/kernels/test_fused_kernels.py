"""Fused elementwise kernels (RMSNorm + residual, SiLU-and-mul) against their torch references.

Without CUDA the kernels run on CPU tensors through Triton's interpreter (float32, and float16, whose rounding
the interpreter emulates faithfully; its bfloat16 casts truncate, so bf16 is checked on the GPU only). With
CUDA the same file runs the compiled kernels in float32, bfloat16 and float16.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel module is first imported

pytest.importorskip("triton")

from flashvlm.kernels import dispatch  # noqa: E402
from flashvlm.kernels import norm as norm_mod  # noqa: E402
from flashvlm.kernels.activation import (  # noqa: E402
    quick_gelu_reference,
    quick_gelu_triton,
    silu_and_mul_reference,
    silu_and_mul_triton,
)
from flashvlm.kernels.norm import (  # noqa: E402
    layer_norm_reference,
    layernorm_triton,
    rms_norm_reference,
    rmsnorm_triton,
)
from flashvlm.kernels.rotary import rotary_qk_inplace  # noqa: E402
from flashvlm.layers.activation import Activation, SiluAndMul, quick_gelu, silu_and_mul  # noqa: E402
from flashvlm.layers.norm import LayerNorm, RMSNorm, fused_add_rmsnorm  # noqa: E402
from flashvlm.layers.rotary import (  # noqa: E402
    MRotaryEmbedding,
    RotaryEmbedding,
    apply_partial_rotary,
    apply_partial_rotary_,
    apply_rotary,
    apply_rotary_qk_,
)

# CPU tensors can only run the kernels if this process imported them under the interpreter; CUDA cases run
# only compiled (the interpreter would take CUDA tensors too, but tests no codegen and truncates bf16).
INTERPRETED = type(norm_mod._norm_kernel).__name__ == "InterpretedFunction"
_CPU_OK = INTERPRETED and dispatch.interpreter_active()
_CUDA_OK = torch.cuda.is_available() and not INTERPRETED
_skip_cpu = pytest.mark.skipif(not _CPU_OK, reason="CPU kernels need TRITON_INTERPRET=1 before import")
_skip_cuda = pytest.mark.skipif(not _CUDA_OK, reason="no CUDA device, or kernels interpreted")

CASES = [
    pytest.param("cpu", torch.float32, marks=_skip_cpu, id="cpu-fp32"),
    pytest.param("cpu", torch.float16, marks=_skip_cpu, id="cpu-fp16"),
    pytest.param("cuda", torch.float32, marks=_skip_cuda, id="cuda-fp32"),
    pytest.param("cuda", torch.bfloat16, marks=_skip_cuda, id="cuda-bf16"),
    pytest.param("cuda", torch.float16, marks=_skip_cuda, id="cuda-fp16"),
]
DEVICES = [pytest.param("cpu", marks=_skip_cpu, id="cpu"), pytest.param("cuda", marks=_skip_cuda, id="cuda")]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(20240607)


def poisoned(shape, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, max_mismatch_frac: float = 0.01) -> None:
    """float32: within 1e-5. Half types: the kernels round where torch rounds, so nearly every element is
    bit-identical; the rest (reduction order, exp/cos implementations) are off by an ulp or two."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape, ref.dtype, ref.shape)
    assert torch.isfinite(out).all(), "kernel left unwritten (poisoned) or non-finite elements"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=4 * eps)
    mismatched = (out != ref).sum().item()
    assert mismatched <= max(2, max_mismatch_frac * out.numel()), f"{mismatched}/{out.numel()} not bit-identical"


# --- RMSNorm ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hidden,rows", [(64, 13), (3584, 5)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(device, dtype, hidden, rows, with_residual):
    # x is a row slice of a wider buffer, so the row stride differs from the hidden size.
    x = torch.randn(rows, hidden + 8, dtype=dtype, device=device)[:, :hidden]
    residual = torch.randn(rows, hidden, dtype=dtype, device=device) if with_residual else None
    weight = torch.randn(hidden, dtype=dtype, device=device)
    x_before = x.clone()
    out = poisoned((rows, hidden), dtype, device)
    res_out = poisoned((rows, hidden), dtype, device) if with_residual else None
    got = rmsnorm_triton(x, residual, weight, 1e-6, out=out, residual_out=res_out)
    ref = rms_norm_reference(x, residual, weight, 1e-6)
    if with_residual:
        assert got[0] is out and got[1] is res_out
        assert_matches(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)  # one rounded add, same as torch
    else:
        assert got is out
        assert_matches(got, ref)
    assert torch.equal(x, x_before), "inputs must not be written"


@pytest.mark.parametrize("device", DEVICES)
def test_rmsnorm_3d_input_and_weight_promotion(device):
    # A float32 weight with float16 activations promotes the output to float32, as `weight * h.to(dtype)` does.
    x = torch.randn(2, 3, 96, dtype=torch.float16, device=device)
    residual = torch.randn(2, 3, 96, dtype=torch.float16, device=device)
    weight = torch.randn(96, dtype=torch.float32, device=device)
    out, res = fused_add_rmsnorm(x, residual, weight, 1e-5, force=True)
    ref_out, ref_res = rms_norm_reference(x, residual, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(res, ref_res)


# --- LayerNorm + residual (vision blocks) ---------------------------------------------------------------------


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("hidden", [80, 1280])  # not a power of two; the Qwen2-VL ViT width
def test_layernorm(device, dtype, hidden):
    x = torch.randn(6, hidden, dtype=dtype, device=device) * 2 + 0.5  # a non-zero mean to subtract
    res = torch.randn(6, hidden, dtype=dtype, device=device)
    w = (torch.rand(hidden, device=device) + 0.5).to(dtype)
    b = torch.randn(hidden, device=device).to(dtype)
    assert_matches(layernorm_triton(x, None, w, b, 1e-6), layer_norm_reference(x, None, w, b, 1e-6))
    out, new_res = layernorm_triton(x, res, w, b, 1e-6)
    ref_out, ref_res = layer_norm_reference(x, res, w, b, 1e-6)
    assert_matches(out, ref_out)
    assert torch.equal(new_res, ref_res)  # the residual stream is exactly the torch sum
    norm = LayerNorm(hidden, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(w)
        norm.bias.copy_(b)
    if device == "cuda":  # the layer dispatches to the kernel on CUDA tensors; CPU ones take torch's path
        assert_matches(norm(x, res)[0], ref_out)


# --- SiLU-and-mul ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("inter", [64, 2500])  # 2500: three column blocks, the last one partial
def test_silu_and_mul(device, dtype, inter):
    x = torch.randn(5, 2 * inter + 16, dtype=dtype, device=device)[:, : 2 * inter] * 3
    out = poisoned((5, inter), dtype, device)
    assert silu_and_mul_triton(x, out=out) is out
    assert_matches(out, silu_and_mul_reference(x))
    x3 = torch.randn(2, 3, 2 * inter, dtype=dtype, device=device)
    assert_matches(silu_and_mul(x3, force=True), silu_and_mul_reference(x3))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("shape", [(7, 300), (3, 5, 1280)])  # partial blocks; a 3-D activation
def test_quick_gelu(device, dtype, shape):
    x = torch.randn(*shape, dtype=dtype, device=device) * 4
    assert_matches(quick_gelu_triton(x), quick_gelu_reference(x))
    assert_matches(quick_gelu(x, force=True), quick_gelu_reference(x))
    strided = torch.randn(shape[0], 2 * shape[-1], dtype=dtype, device=device)[:, ::2]
    assert_matches(quick_gelu_triton(strided), quick_gelu_reference(strided))


def test_activation_module_dispatch(monkeypatch):
    """The vision MLPs' Activation takes the kernel on CUDA tensors unless the layer's kernels are off; the
    others are their torch functions. No weights: checkpoints load as before."""
    act = Activation("quick_gelu")
    assert list(act.state_dict()) == [] and act.use_triton_kernels
    x = torch.randn(4, 8)
    torch.testing.assert_close(act(x), quick_gelu_reference(x))  # CPU tensor: the torch path
    with pytest.raises(ValueError, match="unsupported activation"):
        Activation("swish-ish")


# --- rotary (queries and keys in place on the packed QKV output) ----------------------------------------------


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,mrope", [
    (7, 4, 2, 16, [2, 3, 3]),       # tiny Qwen2-VL shape, M-RoPE
    (3, 28, 4, 128, [16, 24, 24]),  # Qwen2-VL-7B: 32 heads rotated per row, more than one head block
    (5, 3, 1, 24, None),            # 1-D RoPE, head counts and half dim (12) that are not powers of two
])
def test_rotary_qk(device, dtype, tokens, q_heads, kv_heads, head_dim, mrope):
    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=device) * 2
    if mrope is None:
        rope = RotaryEmbedding(head_dim, {"rope_theta": 10000.0}).to(device)
        positions = torch.randint(0, 4000, (tokens,), device=device)
    else:
        rope = MRotaryEmbedding(head_dim, {"mrope_section": mrope}).to(device)
        positions = torch.randint(0, 4000, (3, tokens), device=device)
    cos, sin = rope(positions, dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    ref_q = apply_rotary(q.reshape(tokens, q_heads, head_dim), cos, sin).reshape(tokens, -1)
    ref_k = apply_rotary(k.reshape(tokens, kv_heads, head_dim), cos, sin).reshape(tokens, -1)
    ref_v = v.clone()
    rotary_qk_inplace(qkv, cos, sin, q_heads + kv_heads, head_dim)
    # Half precision: the kernel rounds where torch rounds. The interpreter (CPU) is then bit-identical; compiled on
    # the H200 about a quarter of the elements land one ulp away (2026-11-29), which assert_matches bounds.
    frac = 0.0 if device == "cpu" and dtype != torch.float32 else 0.3
    assert_matches(qkv[:, :q_size], ref_q, max_mismatch_frac=frac)
    assert_matches(qkv[:, q_size:q_size + kv_size], ref_k, max_mismatch_frac=frac)
    assert torch.equal(qkv[:, q_size + kv_size:], ref_v), "values must stay untouched"


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [
    (6, 4, 2, 16),     # the tiny Qwen3-VL text model's heads
    (3, 32, 8, 128),   # Qwen3-VL-8B: more than one head block
])
def test_rotary_qk_with_qk_norm_matches_norm_then_rotary(device, dtype, tokens, q_heads, kv_heads, head_dim):
    # Qwen3: each query and key head RMS-normalized with its own weight, then rotated; values untouched.
    from flashvlm.layers.norm import rms_norm_reference
    from flashvlm.layers.rotary import QKNorm

    q_size, kv_size = q_heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size, dtype=dtype, device=device) * 3
    wq, wk = (torch.rand(head_dim, device=device).to(dtype) + 0.5 for _ in range(2))
    cos, sin = MRotaryEmbedding(head_dim, {"mrope_section": [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16],
                                           "mrope_interleaved": True}).to(device)(
        torch.randint(0, 4000, (3, tokens), device=device), dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    ref_q = apply_rotary(rms_norm_reference(q.reshape(-1, head_dim), None, wq, 1e-6).view(tokens, q_heads, head_dim),
                         cos, sin).reshape(tokens, -1)
    ref_k = apply_rotary(rms_norm_reference(k.reshape(-1, head_dim), None, wk, 1e-6).view(tokens, kv_heads, head_dim),
                         cos, sin).reshape(tokens, -1)
    ref_v = v.clone()
    assert apply_rotary_qk_(qkv, cos, sin, q_heads + kv_heads, head_dim, force=True,
                            qk_norm=QKNorm(wq, wk, q_heads, 1e-6))
    frac = 0.05 if device == "cpu" and dtype != torch.float32 else 0.3  # the norm's sum order: an ulp here and there
    assert_matches(qkv[:, :q_size], ref_q, max_mismatch_frac=frac)
    assert_matches(qkv[:, q_size:q_size + kv_size], ref_k, max_mismatch_frac=frac)
    assert torch.equal(qkv[:, q_size + kv_size:], ref_v), "values must stay untouched"
    assert not apply_rotary_qk_(qkv, cos, sin, q_heads + kv_heads, head_dim, force=True,
                                qk_norm=QKNorm(wq.float() if dtype != torch.float32 else wq.half(), wk, q_heads, 1e-6))


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim", [
    (5, 4, 16, 8),     # the tiny Fuyu
    (3, 64, 64, 32),   # Fuyu-8B / Persimmon-8B: several head blocks
    (2, 3, 24, 24),    # full rotary, a head dim that is not a power of two
])
def test_head_norm_rotary_matches_layernorm_then_partial_rotary(device, dtype, tokens, heads, head_dim, rotary_dim):
    # Persimmon: each query and key head LayerNorm-ed with its own (weight, bias), then partially rotated, in
    # place in the packed projection; the values stay untouched.
    from flashvlm.kernels.head_norm_rotary import head_norm_rotary_inplace, head_norm_rotary_reference

    width = heads * head_dim
    qkv = torch.randn(tokens, 3 * width, dtype=dtype, device=device) * 3 + 0.5
    norms = [(torch.rand(head_dim, device=device).to(dtype) + 0.5, torch.randn(head_dim, device=device).to(dtype))
             for _ in range(2)]
    cos, sin = RotaryEmbedding(rotary_dim, {"rope_theta": 25000.0}).to(device)(
        torch.randint(0, 4000, (tokens,), device=device), dtype)
    ref_q, ref_k = head_norm_rotary_reference(qkv[:, :width], qkv[:, width:2 * width], cos, sin, head_dim, *norms,
                                              1e-5)
    ref_v = qkv[:, 2 * width:].clone()
    head_norm_rotary_inplace(qkv, cos, sin, heads, heads, head_dim, *norms, 1e-5)
    frac = 0.05 if device == "cpu" and dtype != torch.float32 else 0.3  # the norm's sum order: an ulp here and there
    assert_matches(qkv[:, :width], ref_q, max_mismatch_frac=frac)
    assert_matches(qkv[:, width:2 * width], ref_k, max_mismatch_frac=frac)
    assert torch.equal(qkv[:, 2 * width:], ref_v), "values must stay untouched"
    with pytest.raises(ValueError, match="weights and biases"):
        head_norm_rotary_inplace(qkv, cos, sin, heads, heads, head_dim, norms[0], (norms[1][0][:-1], norms[1][1]),
                                 1e-5)


@pytest.mark.parametrize("device,dtype", CASES)
def test_rotary_qk_fp32_math_matches_the_vision_rotary(device, dtype):
    from flashvlm.models.vision.qwen_vit import apply_vision_rotary, vision_position_ids, vision_rotary

    heads, head_dim, n = 16, 80, 64  # the Qwen2-VL ViT's head layout on an 8x8-patch image
    qkv = torch.randn(n, 3 * heads * head_dim, dtype=dtype, device=device) * 2
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device) / (head_dim // 2))
    cos, sin = vision_rotary(vision_position_ids([(1, 8, 8)], 2, torch.device(device)), inv_freq)
    q, k, v = qkv.view(n, 3, heads, head_dim).unbind(1)
    ref_q, ref_k, ref_v = apply_vision_rotary(q, cos, sin), apply_vision_rotary(k, cos, sin), v.clone()
    assert apply_rotary_qk_(qkv, cos, sin, 2 * heads, head_dim, force=True, fp32_math=True)
    q, k, v = qkv.view(n, 3, heads, head_dim).unbind(1)
    # One rounding of a float32 result: at most an ulp apart where float32 sums differ in their last bit.
    assert_matches(q.contiguous(), ref_q, max_mismatch_frac=0.01)
    assert_matches(k.contiguous(), ref_k, max_mismatch_frac=0.01)
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim,packed", [
    (7, 4, 16, 8, False),    # the tiny Fuyu: half of each head rotates
    (3, 64, 64, 32, False),  # Fuyu-8B / Persimmon-8B
    (5, 3, 24, 12, True),    # a strided view of a packed projection (Persimmon without QK-norm)
])
def test_partial_rotary(device, dtype, tokens, heads, head_dim, rotary_dim, packed):
    width = heads * head_dim
    buf = torch.randn(tokens, 3 * width if packed else width, dtype=dtype, device=device) * 2
    x = buf[:, width:2 * width] if packed else buf
    cos, sin = RotaryEmbedding(rotary_dim, {"rope_theta": 25000.0}).to(device)(
        torch.randint(0, 4000, (tokens,), device=device), dtype)
    ref = apply_partial_rotary(x.reshape(tokens, heads, head_dim), cos, sin).reshape(tokens, -1)
    untouched = buf.clone()
    out = apply_partial_rotary_(x, cos, sin, heads, head_dim, force=True)
    assert out.data_ptr() == x.data_ptr(), "the kernel path rotates in place"
    frac = 0.0 if device == "cpu" and dtype != torch.float32 else 0.3
    assert_matches(out, ref, max_mismatch_frac=frac)
    passed = out.view(tokens, heads, head_dim)[..., rotary_dim:]
    assert torch.equal(passed, untouched[:, width:2 * width].reshape(tokens, heads, head_dim)[..., rotary_dim:]
                       if packed else untouched.view(tokens, heads, head_dim)[..., rotary_dim:])
    if packed:
        assert torch.equal(buf[:, :width], untouched[:, :width]) and torch.equal(buf[:, 2 * width:],
                                                                              untouched[:, 2 * width:])
    torch.testing.assert_close(apply_partial_rotary_(x.clone(), cos, sin, heads, head_dim, enabled=False),
                               apply_partial_rotary(x.reshape(tokens, heads, head_dim), cos, sin).reshape(tokens, -1))


@pytest.mark.parametrize("device", DEVICES)
def test_rotary_qk_dispatch_and_bad_shapes(device):
    qkv = torch.randn(4, 6 * 16, device=device)
    cos, sin = torch.randn(4, 16, device=device), torch.randn(4, 16, device=device)
    assert apply_rotary_qk_(qkv, cos, sin, 4, 16, force=True)
    assert not apply_rotary_qk_(qkv, cos, sin, 4, 16, enabled=False)  # the layer's own switch wins
    with pytest.raises(ValueError, match="cos/sin"):
        rotary_qk_inplace(qkv, cos[:3], sin[:3], 4, 16)
    with pytest.raises(ValueError, match="qk must be"):
        rotary_qk_inplace(qkv, cos, sin, 7, 16)
    with pytest.raises(ValueError, match="rotated channels"):
        rotary_qk_inplace(qkv, cos, sin, 4, 16, rotary_dim=18)


# --- dispatch policy -------------------------------------------------------------------------------------------


def test_cpu_tensors_take_the_torch_path_by_default(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("a Triton kernel ran on a CPU tensor without force=True")

    import flashvlm.kernels.activation as act_mod

    monkeypatch.setattr(norm_mod, "rmsnorm_triton", boom)
    monkeypatch.setattr(act_mod, "silu_and_mul_triton", boom)
    monkeypatch.setattr(act_mod, "quick_gelu_triton", boom)
    Activation("quick_gelu")(torch.randn(4, 16))
    x = torch.randn(4, 32)
    assert not dispatch.use_triton(x)
    norm = RMSNorm(32)
    norm(x)
    norm(x, torch.randn(4, 32))
    SiluAndMul()(torch.randn(4, 64))
    rope = MRotaryEmbedding(16, {"mrope_section": [2, 3, 3]})
    q = torch.randn(4, 2, 16)
    positions = torch.arange(12).view(3, 4)
    cos, sin = rope(positions, q.dtype)
    apply_rotary(q, cos, sin)


def test_force_needs_the_interpreter_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        dispatch.use_triton(torch.randn(2), force=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_policy_is_per_layer():
    x = torch.randn(2, 8, device="cuda")
    assert dispatch.use_triton(x)
    assert not dispatch.use_triton(x, enabled=False)


def test_kernel_backend_is_set_per_model() -> None:
    a, b = torch.nn.Sequential(RMSNorm(8), SiluAndMul()), torch.nn.Sequential(RMSNorm(8), SiluAndMul())
    dispatch.set_kernel_backend(a, "torch")
    assert [m.use_triton_kernels for m in a] == [False, False]
    assert [m.use_triton_kernels for m in b] == [True, True]  # another model is untouched
