"""Engine behaviour through the public API on a tiny Qwen2-VL checkpoint (CPU)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from flashvlm import LLM, SamplingParams
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen"), seed=11)


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(str(ckpt), device="cpu", kv_cache_tokens=4096)


def _array(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_image_sources_agree(llm: LLM, tmp_path) -> None:
    """The same picture as PIL, numpy, path, bytes, data URI and chat parts gives the same answer."""
    arr = _array(84, 56, 1)
    path = tmp_path / "pic.png"
    path.write_bytes(_png(arr))
    uri = "data:image/png;base64," + base64.b64encode(_png(arr)).decode()
    sources = [arr, Image.fromarray(arr), str(path), _png(arr), uri]
    outs = llm.generate([{"prompt": IMG + "Describe.", "images": [s]} for s in sources], _greedy())
    assert len({tuple(o.token_ids) for o in outs}) == 1
    chat_outs = llm.chat([[{"role": "user", "content": [part, {"type": "text", "text": "Describe."}]}] for part in (
        {"type": "image_url", "image_url": {"url": uri}}, {"type": "image_url", "image_url": {"url": str(path)}},
        {"type": "image", "image": Image.fromarray(arr)})], _greedy())
    assert len({tuple(o.token_ids) for o in chat_outs}) == 1
    hashes = {llm.engine.process_prompt({"prompt": IMG, "images": [s]}).mm_items[0].mm_hash for s in sources}
    assert len(hashes) == 1


def test_prompt_token_ids_single_or_expanded(llm: LLM) -> None:
    arr = _array(56, 56, 2)
    text = llm.engine.process_prompt({"prompt": IMG + "Hello", "images": [arr]})
    tok = llm.get_tokenizer()
    single = tok.encode(IMG + "Hello")
    a = llm.generate({"prompt_token_ids": single, "images": [arr]}, _greedy())[0]
    b = llm.generate({"prompt_token_ids": text.prompt_token_ids, "images": [arr]}, _greedy())[0]
    assert a.prompt_token_ids == b.prompt_token_ids == text.prompt_token_ids
    assert a.token_ids == b.token_ids


def test_per_request_max_pixels_changes_tokens(llm: LLM) -> None:
    arr = _array(224, 224, 3)
    small = llm.engine.process_prompt({"prompt": IMG, "images": [arr], "mm_processor_kwargs": {"max_pixels": 56 * 56}})
    large = llm.engine.process_prompt({"prompt": IMG, "images": [arr]})
    assert small.mm_items[0].num_tokens < large.mm_items[0].num_tokens
    assert small.mm_items[0].mm_hash != large.mm_items[0].mm_hash


def test_seeded_sampling_is_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt": "Tell me a story."}, seeded)[0]
    batch = llm.generate([{"prompt": "Other prompt."}, {"prompt": "Tell me a story."}, {"prompt": IMG + "x",
                          "images": [_array(56, 56)]}], [other, seeded, other])
    assert batch[1].token_ids == alone.token_ids
    unseeded = {tuple(o.token_ids) for o in llm.generate(["Tell me a story."] * 4, other)}
    assert len(unseeded) > 1  # sampling really samples


def test_stop_conditions(llm: LLM) -> None:
    base = llm.generate("Count with me:", _greedy(12, ignore_eos=True))[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 12
    # stop_token_ids: stop at the 4th generated token
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = llm.generate("Count with me:", _greedy(12, ignore_eos=True, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == base.token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    # stop string: a piece of the base text; the output text ends right before it
    tok = llm.get_tokenizer()
    text = tok.decode(base.token_ids, skip_special_tokens=True)
    needle = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    out = llm.generate("Count with me:", _greedy(12, ignore_eos=True, stop=[needle]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == needle and needle not in out.text
    assert text.startswith(out.text)
    # A stop string completed by the last allowed token still reports "stop".
    first = tok.decode(base.token_ids[:1], skip_special_tokens=True)
    assert first.strip()
    out = llm.generate("Count with me:", _greedy(1, ignore_eos=True, stop=[first]))[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", first, "")


def test_min_tokens_blocks_eos(llm: LLM, monkeypatch) -> None:
    """With eos made the argmax at every step, greedy decoding emits exactly min_tokens other tokens, then eos."""
    model = llm.engine.model
    eos = llm.engine.eos_token_ids[0]
    original = model.compute_logits

    def eos_first(hidden):
        logits = original(hidden)
        logits[:, eos] = logits.max(dim=-1).values + 10.0
        return logits

    monkeypatch.setattr(model, "compute_logits", eos_first)
    outs = llm.generate(["Hi", "Hello"], [SamplingParams(temperature=0.0, min_tokens=4, max_tokens=8),
                                          SamplingParams(temperature=0.0, max_tokens=8)])
    assert eos not in outs[0].token_ids[:4] and outs[0].token_ids[4] == eos and len(outs[0].token_ids) == 5
    assert outs[0].finish_reason == "stop"
    assert outs[1].token_ids == [eos] and outs[1].finish_reason == "stop"


def test_abort_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    req = engine.add_request({"prompt": IMG + "long answer", "images": [_array(112, 112)]},
                             _greedy(50, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort_request(req.request_id)
    assert out.finish_reason == "abort" and out.finished
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert not engine.has_unfinished_requests()
    enc = engine.scheduler.encoder_cache
    assert enc.num_referenced == 0  # the embedding may stay cached for reuse, but nobody holds it
    engine.step()  # delivers the encoder cache's evictions, if any, to the runner
    assert set(engine.runner.encoder_outputs) == enc.held_hashes()
    assert enc.num_cached_tokens <= enc.cache_tokens


def test_priority_first(ckpt) -> None:
    llm = LLM(str(ckpt), device="cpu", kv_cache_tokens=2048, max_num_seqs=1)
    outs = llm.generate(["low priority first", "high priority later"], _greedy(4, ignore_eos=True), priority=[5, 0])
    assert outs[1].first_token_time < outs[0].first_token_time


def test_streaming_text_and_timings(llm: LLM) -> None:
    engine = llm.engine
    req = engine.add_request({"prompt": IMG + "Stream", "images": [_array(56, 84)]}, _greedy(10, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == req.request_id)
    assert [len(o.token_ids) for o in outs] == list(range(1, 11))
    final = outs[-1]
    assert final.text == llm.get_tokenizer().decode(final.token_ids, skip_special_tokens=True)
    assert final.arrival_time <= final.first_token_time <= final.finish_time


def test_generation_config_defaults(ckpt, tmp_path) -> None:
    import json
    import shutil

    path = tmp_path / "gen"
    shutil.copytree(ckpt, path)
    cfg = json.loads((path / "generation_config.json").read_text())
    cfg.update(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)
    (path / "generation_config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024)
    d = llm.engine.default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    assert set(llm.engine.eos_token_ids) >= set(cfg["eos_token_id"])


def test_stage_breakdown_adds_up(llm: LLM) -> None:
    engine = llm.engine
    engine.step_log = []
    try:
        outs = llm.generate([{"prompt": IMG + "Stages?", "images": [_array(112, 84, 9)]}, "text only"],
                            _greedy(6, ignore_eos=True))
    finally:
        steps, engine.step_log = engine.step_log, None
    for out in outs:
        stages = out.stages
        assert set(stages) == {"preprocess", "queue", "vision", "prefill", "decode", "detokenize"}
        assert all(v >= 0 for v in stages.values())
        e2e = out.finish_time - out.arrival_time
        assert abs(sum(stages.values()) - e2e) < 0.05 * e2e + 1e-3
    assert outs[0].stages["vision"] > 0 and outs[1].stages["vision"] == 0
    assert outs[0].stages["preprocess"] > 0
    assert sum(s.num_images for s in steps) == 1
    assert sum(s.num_decode_tokens for s in steps) == 2 * 5  # the first token of each comes from prefill
    assert all(s.forward_s > 0 and s.host_s >= s.forward_s for s in steps)


def test_preprocess_on_device_matches_host(ckpt) -> None:
    """The device path (rescale/normalize/patchify after the PIL resize) equals the host path bit for bit. Both
    run decode_compact, which test_preprocess checks against transformers; so on CPU the pixel check is by
    construction, and what this adds there is the engine end to end (float pixels vs compact ones, same tokens);
    on a GPU it compares the GPU's arithmetic with the CPU's."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    on_device = LLM(str(ckpt), device=device, kv_cache_tokens=2048, preprocess_on_gpu=True, dtype="float32")
    host = LLM(str(ckpt), device="cpu", kv_cache_tokens=2048)
    prompt = {"prompt": IMG + "Describe.", "images": [_array(150, 97, 4)]}
    a = on_device.engine.process_prompt(prompt).mm_items[0]
    b = host.engine.process_prompt(prompt).mm_items[0]
    assert a.pixel_values.device.type == device and a.layout == b.layout and a.mm_hash == b.mm_hash
    assert b.pixel_values.dtype == torch.uint8  # the host path hands over compact rows, finished at encode time
    assert torch.equal(a.pixel_values.cpu(), b.model_pixels())
    if device == "cpu":  # across devices only the pixels are compared: CPU and GPU arithmetic may differ
        params = _greedy(6, ignore_eos=True)
        assert on_device.generate(prompt, params)[0].token_ids == host.generate(prompt, params)[0].token_ids


def test_unseeded_sampling_uses_the_engine_generator(ckpt) -> None:
    import torch

    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = LLM(str(ckpt), device="cpu", kv_cache_tokens=1024, seed=3).generate("Tell me", params)[0].token_ids
    llm = LLM(str(ckpt), device="cpu", kv_cache_tokens=1024, seed=3)
    torch.rand(1000)  # other code using torch's global RNG must not change the engine's samples
    assert llm.generate("Tell me", params)[0].token_ids == a


def test_memory_profile_sampling_leaves_the_engine_generator_alone(ckpt) -> None:
    """The GPU profile samples a full batch to measure the sampler's memory; unseeded requests must get the same
    draws from the engine's seeded generator whether or not it ran (CPU engines skip the profile)."""
    import torch

    runner = LLM(str(ckpt), device="cpu", kv_cache_tokens=1024).engine.runner
    before = runner.sampler.default_generator.get_state().clone()
    logits = torch.randn(runner.config.scheduler.max_num_seqs, runner.model.vocab_size)
    runner.planner.profile_sampler(logits)
    assert torch.equal(runner.sampler.default_generator.get_state(), before)
