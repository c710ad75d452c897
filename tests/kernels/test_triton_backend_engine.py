"""The whole engine on the Triton attention backend gives the reference backend's greedy tokens (float32).

On CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py); on a GPU machine, compiled.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from flashvlm import LLM, SamplingParams  # noqa: E402
from flashvlm.models.registry import resolve_family  # noqa: E402
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl, build_qwen3_vl, build_tiny  # noqa: E402

pytestmark = pytest.mark.slow  # engine runs through the Triton interpreter: minutes on 2 cores

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen3-VL: QK-norm before the fused rotary, and DeepStack columns in the graphs' embedding buffers.
BUILDERS = pytest.mark.parametrize("build", [build_qwen2_vl, build_qwen3_vl], ids=["qwen2_vl", "qwen3_vl"])


@pytest.mark.parametrize("architecture", ["Qwen2VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                                          "LlavaNextForConditionalGeneration"])
def test_triton_backend_matches_reference(tmp_path, architecture: str) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(build_tiny(architecture, tmp_path / "m", seed=13))
    image = resolve_family([architecture]).image_placeholder
    rng = np.random.default_rng(1)
    prompts = [{"prompt": image + "Describe the picture.", "images": [rng.integers(0, 256, (56, 84, 3), np.uint8)]},
               {"prompt": "A text-only question of a different length?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("reference", "triton"):
        # A small token budget forces chunked prefill: chunks after a cached prefix, mixed with decode tokens.
        llm = LLM(path, device=device, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=24,
                  attention_backend=backend, kernel_backend="torch", enforce_eager=True)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["reference"]


def test_proportional_attention_on_the_triton_backend_matches_reference(tmp_path) -> None:
    """Pruned images' key bias through the Triton kernels (prefill chunks, decode) and the reference backend."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(build_qwen2_vl(tmp_path / "m", seed=13))
    rng = np.random.default_rng(4)
    prompts = [{"prompt": IMG + "How many shapes?", "images": [rng.integers(0, 256, (112, 112, 3), np.uint8)]},
               {"prompt": "Text first, then " + IMG, "images": [rng.integers(0, 256, (112, 168, 3), np.uint8)]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs, logits = {}, {}
    for backend in ("reference", "triton"):
        llm = LLM(path, device=device, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=16,
                  attention_backend=backend, kernel_backend="torch", mm_token_pruning="divprune",
                  mm_token_keep_ratio=0.25, mm_token_proportional_attention=True)
        assert llm.engine.runner.executor.slot_bias is not None
        llm.engine.runner.record_logits = True
        done = llm.generate(prompts, params)
        outs[backend] = [(o.token_ids, o.num_image_tokens_kept) for o in done]
        logits[backend] = torch.stack([llm.engine.runner.recorded_logits[o.request_id][0] for o in done])
    assert outs["triton"] == outs["reference"]
    assert [kept for _, kept in outs["reference"]] == [4, 6]
    torch.testing.assert_close(logits["triton"], logits["reference"], rtol=1e-4, atol=1e-4)


@BUILDERS
def test_fused_rotary_feeds_strided_queries_to_the_kernels(build, tmp_path, monkeypatch) -> None:
    """With the fused rotary kernel (decoder, Qwen3's with its QK-norm, and the vision tower's float32 variant), q
    and k reach the attention kernels as strided views of the packed QKV output; the tokens must not change
    (float32, the rotary kernel forced on for CPU tensors too)."""
    import flashvlm.layers.rotary as rotary_mod
    from flashvlm.kernels import dispatch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(build(tmp_path / "m", seed=5))
    rng = np.random.default_rng(2)
    prompts = [{"prompt": IMG + "What is shown?", "images": [rng.integers(0, 256, (56, 56, 3), np.uint8)]},
               {"prompt": "Text only, a little longer than the other one."}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    calls = []

    def rotary_on_cpu_too(x, enabled=None, force=False):
        calls.append(enabled)
        return enabled is not False and (x.is_cuda or dispatch.interpreter_active())

    import flashvlm.kernels.rotary as kernel_mod

    modes: set[bool] = set()
    normed: set[bool] = set()
    kernel = kernel_mod.rotary_qk_inplace

    def recording_kernel(*args, fp32_math=False, qk_norm=None):
        modes.add(fp32_math)
        normed.add(qk_norm is not None)
        return kernel(*args, fp32_math=fp32_math, qk_norm=qk_norm)

    outs = {}
    for kernels in ("torch", "triton"):
        if kernels == "triton":
            monkeypatch.setattr(rotary_mod, "use_triton", rotary_on_cpu_too)
            monkeypatch.setattr(kernel_mod, "rotary_qk_inplace", recording_kernel)
        llm = LLM(path, device=device, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=24,
                  attention_backend="triton", kernel_backend=kernels if device == "cuda" else "torch",
                  enforce_eager=True)
        if kernels == "triton" and device == "cpu":
            for layer in llm.engine.runner.model.modules():
                if hasattr(layer, "qkv_proj") or hasattr(layer, "qkv"):
                    layer.use_triton_kernels = True  # decoder and vision rotary only; norms stay on torch
        outs[kernels] = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls and any(c is not False for c in calls), "the fused rotary path never ran"
    assert modes == {False, True}, "the decoder (rounding like bf16 torch) and the vision tower (float32) both ran it"
    # Qwen3-VL's decoder normalizes each query and key head in the same launch.
    assert normed == ({False, True} if build is build_qwen3_vl else {False})
    assert outs["triton"] == outs["torch"]


def test_fuyu_on_the_triton_backend_with_the_partial_rotary_kernel(tmp_path, monkeypatch) -> None:
    """Fuyu's Persimmon decoder (head dim 16, half of it rotating) on the Triton attention backend, its QK-norm and
    partial rotary through one fused kernel (forced on for CPU tensors too), chunked prefill through its image: the
    reference backend's torch path's greedy tokens."""
    import flashvlm.kernels.head_norm_rotary as fused_mod
    import flashvlm.layers.rotary as rotary_mod
    from flashvlm.kernels import dispatch
    from flashvlm.testing.tiny_checkpoints import build_fuyu

    fused: list[int] = []
    head_norm_rotary = fused_mod.head_norm_rotary_inplace

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(build_fuyu(tmp_path / "fuyu", seed=13))
    rng = np.random.default_rng(3)
    prompts = [{"prompt": "Describe the picture.", "images": [rng.integers(0, 256, (84, 140, 3), np.uint8)]},
               {"prompt": "A text-only question of a different length?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs, calls = {}, []
    for backend in ("reference", "triton"):
        if backend == "triton":
            def on_cpu_too(x, enabled=None, force=False):
                calls.append(enabled)
                return enabled is not False and (x.is_cuda or dispatch.interpreter_active())

            monkeypatch.setattr(rotary_mod, "use_triton", on_cpu_too)
            monkeypatch.setattr(fused_mod, "head_norm_rotary_inplace",
                                lambda *a: fused.append(1) or head_norm_rotary(*a))
        llm = LLM(path, device=device, dtype="float32", kv_cache_tokens=1024, max_num_batched_tokens=24,
                  attention_backend=backend, kernel_backend="torch", enforce_eager=True)
        if backend == "triton":
            for layer in llm.engine.runner.model.modules():
                if hasattr(layer, "query_key_value"):
                    layer.use_triton_kernels = True  # QK-norm + rotary only; the other norms and GEMVs on torch
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls and any(c is True for c in calls), "the QK-norm + partial rotary kernel never ran"
    assert fused, "the per-head LayerNorm and the partial rotary did not run in one launch"
    assert outs["triton"] == outs["reference"]


@BUILDERS
def test_step_graphs_serve_prefill_and_mixed_steps_with_the_same_tokens(build, tmp_path) -> None:
    """Prefill chunks, cached-prefix extends and mixed batches through the step graphs (padded to their bucket)
    give the eager path's greedy tokens. On CPU the graphs' padded body runs eagerly (no capture): that is what
    the padding semantics rest on; on CUDA the engine captures and replays the real graphs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = str(build(tmp_path / "m", seed=21))
    rng = np.random.default_rng(4)
    pic = rng.integers(0, 256, (56, 84, 3), np.uint8)
    prompts = [{"prompt": IMG + "Describe the picture.", "images": [pic]},
               {"prompt": "A text-only question that is a little longer than the others?"},
               {"prompt": IMG + "Again, the same picture: what colour?", "images": [pic]}]  # a prefix-cache hit
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    opts = dict(device=device, dtype="float32", kv_cache_tokens=2048, max_num_batched_tokens=32,
                attention_backend="triton", kernel_backend="torch")
    eager = LLM(path, enforce_eager=True, **opts)
    expected = [o.token_ids for o in eager.generate(prompts, params)]

    llm = LLM(path, prefill_graph_max_tokens=32, **opts)
    runner = llm.engine.runner
    if device == "cpu":
        runner.step_graphs = runner.build_step_graphs(32)
    assert runner.step_graphs is not None
    served = []
    run = runner.step_graphs.run

    def counting_run(embeds, positions, meta, sample_rows, token_bias=None):
        served.append((embeds.shape[0], meta.num_seqs))
        return run(embeds, positions, meta, sample_rows, token_bias)

    runner.step_graphs.run = counting_run
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert any(n < 32 for n, _ in served) and any(b > 1 for _, b in served), served  # padded, and mixed


def test_step_buckets() -> None:
    from flashvlm.runner.step_graphs import step_buckets

    assert step_buckets(64, 8) == [(16, 1), (16, 4), (16, 8), (32, 1), (32, 4), (32, 8), (64, 1), (64, 4), (64, 8)]
    assert step_buckets(100, 1) == [(16, 1), (32, 1), (64, 1), (100, 1)]
    assert max(step_buckets(512, 256)) == (512, 256)
    assert all(s <= t for t, s in step_buckets(512, 256))
    large = [b for b in step_buckets(1100, 16) if b[0] > 512]
    assert [b for b in large if b[1] == 1] == [(576 + 64 * i, 1) for i in range(9)] + [(1100, 1)]  # whole prompts
    assert [b for b in large if b[1] > 1] == [(1024, 4), (1024, 16)]  # big mixed batches: coarse buckets


# Decode-graph tests: a short max_model_len keeps the decode split count (and the interpreter's time) small.
DECODE_OPTS = dict(device="cuda" if torch.cuda.is_available() else "cpu", dtype="float32", kv_cache_tokens=2048,
                   max_num_seqs=4, attention_backend="triton", kernel_backend="torch", prefill_graph_max_tokens=0,
                   max_model_len=64)


def _three_prompts(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": IMG + "One.", "images": [rng.integers(0, 256, (56, 56, 3), np.uint8)]},
            {"prompt": "Two, text only, and longer."}, {"prompt": "Three."}]


def _decode_graphs_on_cpu(llm: LLM, lookahead: bool) -> None:
    """On CPU the engine builds no decode graphs (nor the lookahead on them): build what it builds on CUDA, whose
    bodies then run eagerly on the same buffers. On CUDA the engine's own are used."""
    from flashvlm.runner.cuda_graph import DecodeGraphs
    from flashvlm.runner.lookahead import GreedyDecodePipeline

    runner, engine = llm.engine.runner, llm.engine
    if runner.device.type != "cpu":
        return
    runner.graphs = DecodeGraphs(runner.model, runner.backend, runner.kv_caches, engine.config.scheduler.max_num_seqs,
                                 engine.max_model_len, runner.block_size, runner.device, runner.executor.slot_bias)
    if lookahead:
        runner.pipeline = GreedyDecodePipeline(runner.graphs, runner.block_size, engine.max_model_len)
        # What the engine derives and passes when it builds the pipeline itself.
        engine.limits = dataclasses.replace(engine.limits, lookahead_slots=1)
        engine.scheduler._lookahead_slots = 1


def _recorded(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[list, torch.Tensor]:
    runner = llm.engine.runner
    runner.record_logits, runner.recorded_logits = True, {}
    done = llm.generate(prompts, params)
    logits = torch.cat([torch.stack(runner.recorded_logits[o.request_id]) for o in done])
    return [o.token_ids for o in done], logits


def _graphed_llm(path: str, opts: dict, lookahead: bool) -> tuple[LLM, list[str]]:
    """An engine whose steps take the graphs (on CPU their bodies, built as on CUDA), and the execution path of
    every step it plans."""
    llm = LLM(path, **opts)
    runner = llm.engine.runner
    if runner.device.type == "cpu":
        runner.step_graphs = runner.build_step_graphs(32)
        _decode_graphs_on_cpu(llm, lookahead=lookahead)
    paths: list[str] = []
    plan = runner.executor.plan

    def recording_plan(*args, **kwargs):
        chosen = plan(*args, **kwargs)
        paths.append(chosen.path.name)
        return chosen

    runner.executor.plan = recording_plan
    return llm, paths


def test_proportional_attention_through_the_graphs_gives_the_eager_answer(tmp_path) -> None:
    """Pruned images' key bias through the step graphs (the step's token bias copied into their buffer, written
    with the keys) and the decode graphs (each zeroes its new slots' bias): the eager path's tokens and logits.
    Then every slot's bias is set to 5, as stale values a freed block could leave: a text prompt must still get
    the fresh eager engine's answer, so the graphs wrote its prompt's and its decoded tokens' zeros (a stale 5 on
    those keys moves the logits far past the tolerance). Recording logits keeps decode off the lookahead, so a
    second engine runs the same through the lookahead (which replays the decode graphs), tokens only."""
    path = str(build_qwen2_vl(tmp_path / "m", seed=13))
    rng = np.random.default_rng(4)
    prompts = [{"prompt": IMG + "How many shapes?", "images": [rng.integers(0, 256, (112, 112, 3), np.uint8)]},
               {"prompt": "Text first, then " + IMG, "images": [rng.integers(0, 256, (112, 168, 3), np.uint8)]},
               {"prompt": "Only text."}]
    text = [{"prompt": "A text question after the pictures?"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    opts = dict(DECODE_OPTS, prefill_graph_max_tokens=32, max_num_batched_tokens=32, mm_token_pruning="divprune",
                mm_token_keep_ratio=0.25, mm_token_proportional_attention=True)
    eager = LLM(path, enforce_eager=True, **opts)
    expected, expected_logits = _recorded(eager, prompts, params)
    expected_text, expected_text_logits = _recorded(LLM(path, enforce_eager=True, **opts), text, params)

    llm, paths = _graphed_llm(path, opts, lookahead=False)
    runner = llm.engine.runner
    assert runner.graphs.slot_bias is runner.executor.slot_bias is runner.step_graphs.slot_bias is not None
    got, got_logits = _recorded(llm, prompts, params)
    assert got == expected
    torch.testing.assert_close(got_logits, expected_logits, rtol=1e-4, atol=1e-4)
    # Recorded logits keep decode steps off the lookahead, which replays the same decode graphs.
    assert {"STEP_GRAPH", "DECODE_GRAPH"} <= set(paths) and "EAGER" not in paths, paths
    runner.executor.slot_bias.fill_(5.0)
    got_text, got_text_logits = _recorded(llm, text, params)
    assert got_text == expected_text
    torch.testing.assert_close(got_text_logits, expected_text_logits, rtol=1e-4, atol=1e-4)

    ahead, paths = _graphed_llm(path, opts, lookahead=True)
    assert [o.token_ids for o in ahead.generate(prompts, params)] == expected
    ahead.engine.runner.executor.slot_bias.fill_(5.0)
    assert [o.token_ids for o in ahead.generate(text, params)] == expected_text
    assert "LOOKAHEAD" in paths and "EAGER" not in paths, paths


@BUILDERS
def test_decode_graphs_staging_gives_the_eager_tokens(build, tmp_path) -> None:
    """Decode steps through the decode graphs' pinned staging buffers (a DecodeBatch written on the host, one
    copy per buffer, padded rows) give the eager path's tokens. On CPU the graph body runs eagerly on the same
    buffers; on CUDA the engine captures and replays the graphs."""
    path = str(build(tmp_path / "m", seed=8))
    prompts = _three_prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 3, 8)]
    expected = [o.token_ids for o in LLM(path, enforce_eager=True, **DECODE_OPTS).generate(prompts, params)]
    llm = LLM(path, decode_lookahead=False, **DECODE_OPTS)  # on CUDA the lookahead would bypass graphs.run
    runner = llm.engine.runner
    _decode_graphs_on_cpu(llm, lookahead=False)
    sizes = []
    run = runner.graphs.run

    def counting_run(batch):
        sizes.append(batch.num_seqs)
        return run(batch)

    runner.graphs.run = counting_run
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert 3 in sizes and any(s < 3 for s in sizes), sizes  # padded to 4, and smaller batches as requests end


def _record_kv_at_finish(llm: LLM) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Each finished request's K/V (every layer, every token it computed), copied as its blocks are released and
    keyed by its prompt: slots differ between two engines whose steps are scheduled differently, positions don't."""
    runner, scheduler = llm.engine.runner, llm.engine.scheduler
    blocks, block_size = scheduler.block_manager, runner.block_size
    kv: dict[tuple[int, ...], list[torch.Tensor]] = {}
    forget = blocks.forget

    def copy_then_forget(request_id: str) -> None:
        req = scheduler.requests[request_id]
        slots = torch.tensor([b * block_size + j for b in blocks.get_block_ids(request_id) for j in range(block_size)])
        slots = slots[: req.num_computed_tokens].to(runner.device)
        kv[tuple(req.prompt_token_ids)] = [cache.flatten(1, 2)[:, slots].cpu() for cache in runner.kv_caches]
        forget(request_id)

    blocks.forget = copy_then_forget
    return kv


def test_decode_graphs_padding_a_row_a_finished_request_left(tmp_path) -> None:
    """Four requests decode in the 4-row graph; the second finishes first, so the next steps pad 3 rows to 4 with
    a row whose staging entries (both mirrors) still hold the last request's earlier slots. The padding row must
    write nothing there: the tokens, and every request's K/V in every layer, equal the eager path's. (The K/V is
    the sharper check: a padding row's garbage lands in a later layer's cache of a live request, which this tiny
    model's greedy tokens may shrug off.)"""
    path = str(build_qwen2_vl(tmp_path / "m", seed=8))
    prompts = [*_three_prompts(6), {"prompt": "Four, the last one."}]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 4, 9, 9)]
    eager = LLM(path, enforce_eager=True, **DECODE_OPTS)
    expected_kv = _record_kv_at_finish(eager)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    llm = LLM(path, decode_lookahead=False, **DECODE_OPTS)  # on CUDA the lookahead would bypass graphs.run
    _decode_graphs_on_cpu(llm, lookahead=False)
    kv = _record_kv_at_finish(llm)
    graphs = llm.engine.runner.graphs
    sizes = []
    run = graphs.run

    def counting_run(batch):
        sizes.append(batch.num_seqs)
        return run(batch)

    graphs.run = counting_run
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    # The scenario happened: a 4-row step (row 3 staged with a real slot), then several padded 3-row steps, so the
    # mirror that staged it is reused for a padded step.
    assert 4 in sizes and sizes.count(3) >= 2 and sizes.index(3) > sizes.index(4), sizes
    assert graphs.padded_size(3) == 4
    assert kv.keys() == expected_kv.keys() and len(kv) == len(prompts)
    for prompt, layers in expected_kv.items():
        for layer, (got, want) in enumerate(zip(kv[prompt], layers, strict=True)):
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3, msg=lambda m, i=layer: f"layer {i}: {m}")


def test_greedy_lookahead_gives_the_eager_tokens(tmp_path) -> None:
    """Greedy decode through the lookahead pipeline (each step launched before the previous one's tokens are
    read, with those tokens fed on the device) gives the eager tokens: across requests of different lengths,
    block boundaries, a stop token that ends a request after its lookahead was launched (dropped), and a
    sampled request in the batch (no lookahead while it runs)."""
    path = str(build_qwen2_vl(tmp_path / "m", seed=9))
    prompts = _three_prompts(2)
    opts = dict(DECODE_OPTS, block_size=16)
    eager = LLM(path, enforce_eager=True, **opts)
    free_run = eager.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    stop = free_run.token_ids[4]  # request 2 stops on it, one step after a lookahead went out for it
    params = [SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[stop]),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)]
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    assert len(expected[1]) < 8  # the stop token did end it early
    llm = LLM(path, **opts)
    _decode_graphs_on_cpu(llm, lookahead=True)
    pipeline = llm.engine.runner.pipeline
    assert llm.engine.scheduler.lookahead_slots == 1
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert pipeline.num_lookaheads > 10 and pipeline.num_dropped >= 1
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True)
    mixed = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), sampled, sampled]
    before = pipeline.num_lookaheads
    mixed_prompts = [prompts[2], prompts[1], prompts[2]]
    assert ([o.token_ids for o in llm.generate(mixed_prompts, mixed)]
            == [o.token_ids for o in eager.generate(mixed_prompts, mixed)])
    assert pipeline.num_lookaheads > before  # once the sampled request is done, the greedy ones go ahead again


def test_no_lookahead_past_max_model_len(tmp_path) -> None:
    """A request that ends at max_model_len gets no lookahead launched for the step after its last (it could only
    be dropped), and its tokens equal the eager path's."""
    path = str(build_qwen2_vl(tmp_path / "m", seed=9))
    prompt = {"prompt": "Two, text only, and longer."}
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)  # more than max_model_len allows
    expected = LLM(path, enforce_eager=True, **DECODE_OPTS).generate(prompt, params)[0]
    llm = LLM(path, **DECODE_OPTS)
    _decode_graphs_on_cpu(llm, lookahead=True)
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == expected.token_ids and out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == DECODE_OPTS["max_model_len"]
    pipeline = llm.engine.runner.pipeline
    assert pipeline.num_lookaheads > 10 and pipeline.num_dropped == 0 and pipeline._ahead is None
