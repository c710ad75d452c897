"""Video input on the Qwen families against transformers in float32: prompt token ids (placeholders, Qwen3-VL's
timestamps) from transformers' own processors' placeholder rule, greedy tokens and first-step logits of its model
fed pixel_values_videos / video_grid_thw (/ second_per_grid_ts); decoding a clip written here with PyAV; bad input.

transformers' video processors need torchvision, which the pinned set lacks, so pixel_values_videos are built here
from the frames with its patchify order written out (frames are sized so nothing is resized)."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.request import InvalidRequestError
from tests.e2e.test_parity import Family, _image, _llm

QWEN = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
KWARGS = {"video_min_pixels": 32 * 32}
"""Low enough that no tiny clip here is resized (Qwen3-VL's budget covers the whole clip)."""


@pytest.fixture(scope="module", params=QWEN)
def family(request, tmp_path_factory) -> Family:
    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl, build_qwen3_vl

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_vl":
        build_qwen3_vl(path, seed=3)
    else:
        build_qwen2_vl(path, qwen25=request.param == "qwen2_5_vl", seed=3)
    return Family(request.param, path)


def _clip(n: int, w: int, h: int, seed: int) -> list[np.ndarray]:
    base = _image(w, h, seed)
    return [np.roll(base, 7 * i, axis=1) for i in range(n)]


def _patchify(frames: list[np.ndarray], proc) -> tuple[torch.Tensor, list[int]]:
    """transformers' Qwen2VLVideoProcessor rescale/normalize + patchify (the last frame repeated to a whole
    temporal patch)."""
    x = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float() / 255
    mean, std = torch.tensor(proc.image_mean).view(1, 3, 1, 1), torch.tensor(proc.image_std).view(1, 3, 1, 1)
    x = ((x - mean) / std)[None]
    tp, p, m = proc.temporal_patch_size, proc.patch_size, proc.merge_size
    if pad := -x.shape[1] % tp:
        x = torch.cat([x, x[:, -1:].expand(-1, pad, -1, -1, -1)], dim=1)
    _, t, c, h, w = x.shape
    gt, gh, gw = t // tp, h // p, w // p
    x = x.view(1, gt, tp, c, gh // m, m, p, gw // m, m, p).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(gt * gh * gw, c * tp * p * p), [gt, gh, gw]


def _reference(family: Family, llm: LLM, text: str, videos: list, images: list,
               metadata: list | None = None, totals: list | None = None) -> dict:
    """transformers' inputs: the text expanded by its processor's replace_video_token/replace_image_token;
    `metadata`: each video's (fps, sampled frame indices), else frames without metadata."""
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    tok, proc = llm.engine.checkpoint.tokenizer, llm.engine.input_processor.image_processor
    qwen3 = family.name == "qwen3_vl"
    cls = Qwen3VLProcessor if qwen3 else Qwen2VLProcessor
    ns = SimpleNamespace(video_processor=proc, image_processor=proc, video_token="<|video_pad|>",
                         image_token="<|image_pad|>", vision_start_token="<|vision_start|>",
                         vision_end_token="<|vision_end|>", _calculate_timestamps=lambda *a: cls._calculate_timestamps(
                             None, *a))
    pv, grids = zip(*[_patchify(v, proc) for v in videos]) if videos else ((), ())
    metadata = metadata or [(None, list(range(len(v)))) for v in videos]
    video_inputs = {"video_grid_thw": torch.tensor(grids),
                    "video_metadata": [SimpleNamespace(fps=fps, frames_indices=idx) for fps, idx in metadata]}
    pieces = text.split("<|video_pad|>")
    text = pieces[0] + "".join(cls.replace_video_token(ns, video_inputs, i) + piece
                               for i, piece in enumerate(pieces[1:]))
    processed_images = llm.engine.process_prompt({"prompt": IMAGE * len(images), "images": images}).mm_items
    image_grids = torch.tensor([it.layout for it in processed_images]).view(-1, 3)
    for i in range(len(images)):
        text = text.replace("<|image_pad|>", "\0" * int(image_grids[i].prod() // proc.merge_size ** 2), 1)
    ids = torch.tensor([tok.encode(text.replace("\0", "<|image_pad|>"), add_special_tokens=False)])
    cfg = family.config
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": ((ids == cfg.image_token_id).long() + 2 * (ids == cfg.video_token_id).long())}
    if videos:
        inputs.update(pixel_values_videos=torch.cat(pv), video_grid_thw=torch.tensor(grids))
        if family.name == "qwen2_5_vl":
            # Qwen2_5_VLProcessor: temporal_patch_size / VideoMetadata.sampled_fps
            inputs["second_per_grid_ts"] = torch.tensor([
                proc.temporal_patch_size / (24.0 if fps is None else len(idx) / total * fps)
                for (fps, idx), total in zip(metadata, totals or [None] * len(videos))])
    if images:
        inputs.update(pixel_values=torch.cat([it.model_pixels() for it in processed_images]),
                      image_grid_thw=image_grids)
    return inputs


def _check(family: Family, llm: LLM, text: str, videos: list, images: list = (), sources: list | None = None,
           metadata: list | None = None, totals: list | None = None) -> None:
    """`sources`: what the engine gets instead of the frames `videos` transformers gets (a file)."""
    prompt = {"prompt": text, "videos": sources or videos, "images": list(images), "mm_processor_kwargs": KWARGS}
    inputs = _reference(family, llm, text, videos, list(images), metadata, totals)
    assert llm.engine.process_prompt(prompt).prompt_token_ids == inputs["input_ids"][0].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.engine.runner.record_logits = True
    llm.engine.runner.recorded_logits.clear()
    out = llm.generate(prompt, params)[0]
    with torch.inference_mode():
        first = family.hf(**inputs).logits[0, -1]
        ref = family.hf.generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    ours = llm.engine.runner.recorded_logits[out.request_id][0]
    assert (ours - first).abs().max().item() <= 1e-4
    assert out.outputs[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


def _factor(family: Family) -> int:
    return 32 if family.name == "qwen3_vl" else 28


def test_short_clip(family: Family) -> None:
    f = _factor(family)
    _check(family, _llm(family), f"<|im_start|>user\n{VIDEO}what happens?<|im_end|>\n",
           [_clip(4, 2 * f, 3 * f, seed=1)])


def test_chunked_prefill_through_a_clip(family: Family) -> None:
    """A step budget of 8 tokens splits the clip's frames and their tokens across steps."""
    f = _factor(family)
    _check(family, _llm(family, max_num_batched_tokens=8), f"look{VIDEO}now", [_clip(6, 2 * f, 4 * f, seed=13)])


def test_more_patches_than_rows(family: Family) -> None:
    """Five temporal patches of 2x2 tokens: the time axis runs past the spatial ones, so generation continues
    from the position after the prompt's last, not from the largest."""
    pytest.importorskip("av")
    from flashvlm.processing.video import load_video

    f = _factor(family)
    # A file at 2 fps, sampled at 2 fps: every frame, one second a temporal patch. (Frames given as a list are at
    # 24 fps, where transformers 5.17 truncates Qwen2.5-VL's 1/12 s a patch to 0 and later releases do not.)
    data = _encode(_clip(10, 2 * f, 2 * f, seed=9), fps=2)
    frames = list(load_video(data, lambda total, fps: np.arange(total)).frames)
    _check(family, _llm(family), f"{VIDEO}go", [frames], sources=[data], metadata=[(2.0, list(range(10)))],
           totals=[10])


def test_clip_and_image(family: Family) -> None:
    f = _factor(family)
    _check(family, _llm(family), f"{IMAGE}then{VIDEO}and", [_clip(3, 3 * f, 2 * f, seed=2)],
           [_image(56, 112, seed=5)])


def test_two_clips(family: Family) -> None:
    f = _factor(family)
    _check(family, _llm(family), f"a{VIDEO}b{VIDEO}c", [_clip(4, 2 * f, 2 * f, seed=3), _clip(2, 4 * f, 2 * f, 4)])


def _encode(frames: list[np.ndarray], fps: int = 10) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def test_decoded_file_sampling_and_cache_key(family: Family, tmp_path) -> None:
    """A 3 s clip at 10 fps decodes to 30 frames and is sampled at 2 fps to 6 (Qwen2-VL: floor to pairs, Qwen3-VL:
    int(30/10*2)); bytes, a path and a data URI give one hash, another fps another."""
    import base64

    pytest.importorskip("av")
    data = _encode(_clip(30, 64, 64, seed=6))
    from flashvlm.processing.video import load_video

    t0 = time.perf_counter()
    video = load_video(data, lambda total, fps: np.arange(total))
    print(f"PyAV decode of 30 64x64 mpeg4 frames: {1e3 * (time.perf_counter() - t0):.1f} ms")
    assert video.frames.shape == (30, 64, 64, 3) and video.fps == 10
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    llm = _llm(family)
    uri = "data:video/mp4;base64," + base64.b64encode(data).decode()
    hashes = []
    for src, kw in ((data, {}), (str(path), {}), (uri, {}), (data, {"fps": 1.0})):
        items = llm.engine.process_prompt({"prompt": VIDEO, "videos": [src], "mm_processor_kwargs": kw}).mm_items
        hashes.append(items[0].mm_hash)
        assert len(items) == (3 if not kw else 2)
    assert hashes[0] == hashes[1] == hashes[2] != hashes[3]
    out = llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}},
                                                 {"type": "text", "text": "hi"}]}],
                   SamplingParams(max_tokens=2)) if "video" in (llm.engine.checkpoint.chat_template or "") else None
    assert out is None or out[0].outputs[0].token_ids


def test_decoded_file_time_positions(family: Family) -> None:
    """A 3 s file at 10 fps sampled at 2 fps: transformers' frame indices (Qwen2VLVideoProcessor: arange(0, 30, 5);
    Qwen3VLVideoProcessor: linspace(0, 29, 6).round()), Qwen2.5-VL's second_per_grid_ts of 1 s (time positions
    stepping by tokens_per_second), Qwen3-VL's timestamps from the source fps."""
    pytest.importorskip("av")
    from flashvlm.processing.video import load_video

    data = _encode(_clip(30, 2 * _factor(family), 2 * _factor(family), seed=8), fps=10)
    decoded = load_video(data, lambda total, fps: np.arange(total)).frames
    indices = [0, 6, 12, 17, 23, 29] if family.name == "qwen3_vl" else [0, 5, 10, 15, 20, 25]
    frames = [decoded[i] for i in indices]
    _check(family, _llm(family), f"x{VIDEO}y", [frames], sources=[data], metadata=[(10.0, indices)], totals=[30])


@pytest.mark.parametrize("bad,kwargs,match", [
    (b"not a video at all", {}, "cannot decode"),
    ([], {}, "at least one frame"),
    ("/no/such/file.mp4", {}, "not a regular file"),
    ("data:image/png;base64,AAAA", {}, "media type"),
    ([np.zeros((64, 64, 3), np.uint8)] * 8, {"max_frames": 4}, "max_frames"),
    ([np.zeros((64, 64, 3), np.uint8)] * 2, {"max_frames": 10_000}, "limit"),
    ([np.zeros((64, 64, 3), np.uint8)] * 2, {"video_min_pixels": 10 ** 9, "video_max_pixels": 10 ** 9},
     "exceeds|planned"),
    ([np.zeros((64, 64, 3), np.uint8), np.zeros((32, 64, 3), np.uint8)], {}, "share one size"),
])
def test_bad_video(family: Family, bad, kwargs, match) -> None:
    llm = _llm(family)
    with pytest.raises(InvalidRequestError, match=match):
        llm.engine.process_prompt({"prompt": VIDEO, "videos": [bad], "mm_processor_kwargs": kwargs})
    out = llm.generate("still fine", SamplingParams(max_tokens=2))  # nothing else disturbed
    assert len(out[0].outputs[0].token_ids) == 2


def test_placeholder_count_mismatch(family: Family) -> None:
    llm = _llm(family)
    with pytest.raises(InvalidRequestError, match="videos in one prompt"):
        llm.engine.process_prompt({"prompt": VIDEO * 17, "videos": [_clip(2, 64, 64, 0)] * 17})
    with pytest.raises(InvalidRequestError, match="video placeholder"):
        llm.engine.process_prompt({"prompt": "no placeholder", "videos": [_clip(2, 64, 64, 0)]})


def test_model_without_video(tmp_path) -> None:
    from flashvlm.testing.tiny_checkpoints import build_llava

    build_llava(tmp_path / "llava", seed=0)
    llm = LLM(str(tmp_path / "llava"), device="cpu", dtype="float32", kv_cache_tokens=1024)
    with pytest.raises(InvalidRequestError, match="no video input"):
        llm.engine.process_prompt({"prompt": "x", "videos": [_clip(2, 64, 64, 0)]})
    with pytest.raises(InvalidRequestError, match="no video input"):
        llm.engine.process_chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x.mp4"}}]}])


def test_temporal_pruning(family: Family) -> None:
    """video_pruning 'temporal': a still clip keeps the first temporal patch and one token of each later one, the
    text after the video keeps its position (the rope delta), and a repeat request reuses the prefix cache; a
    clip whose every token changes is not pruned and gives exactly the unpruned output."""
    f = _factor(family)
    llm = _llm(family)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    still = [_image(2 * f, 2 * f, seed=11)] * 6
    base = {"prompt": f"{VIDEO}what moves?", "videos": [still], "mm_processor_kwargs": dict(KWARGS)}
    pruned = {**base, "mm_processor_kwargs": {**KWARGS, "video_pruning": "temporal"}}
    full_items = llm.engine.process_prompt(base).mm_items
    items = llm.engine.process_prompt(pruned).mm_items
    assert [it.num_tokens for it in items] == [full_items[0].num_tokens, 1, 1]
    p_full = llm.engine.model.prompt_positions(llm.engine.process_prompt(base).prompt_token_ids, full_items)
    processed = llm.engine.process_prompt(pruned)
    p_pruned = llm.engine.model.prompt_positions(processed.prompt_token_ids, processed.mm_items)
    assert p_pruned[0][:, -1].tolist() == p_full[0][:, -1].tolist()  # the last text token sits where it did
    llm.engine.runner.record_logits = True
    outs = llm.generate([base, pruned], params)
    logits = [llm.engine.runner.recorded_logits[o.request_id][0] for o in outs]
    print(f"{family.name}: still clip, temporal pruning keeps {sum(it.num_tokens for it in items)} of "
          f"{sum(it.num_tokens for it in full_items)} tokens; first-step logits differ by at most "
          f"{(logits[0] - logits[1]).abs().max().item():.4f}, greedy tokens "
          f"{'equal' if outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids else 'differ'}")
    again = llm.generate(pruned, params)[0]
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert again.num_cached_tokens > 0  # the prefix cache keys frames by their hash and pruning setting
    chunked = _llm(family, max_num_batched_tokens=8).generate(pruned, params)[0]
    assert chunked.outputs[0].token_ids == outs[1].outputs[0].token_ids
    moving = {**pruned, "videos": [_clip(4, 2 * f, 2 * f, seed=12)]}
    assert all(it.pruning is None for it in llm.engine.process_prompt(moving).mm_items)
    a, b = llm.generate([moving, {**moving, "mm_processor_kwargs": KWARGS}], params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("kwargs,match", [({"video_pruning": "evs"}, "video_pruning"),
                                          ({"video_pruning_threshold": -1}, "threshold"),
                                          ({"mm_token_pruning": "pool"}, "mm_token_pruning")])
def test_bad_video_pruning(family: Family, kwargs, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        _llm(family).engine.process_prompt({"prompt": VIDEO, "videos": [_clip(2, 64, 64, 0)],
                                            "mm_processor_kwargs": kwargs})


def test_file_limits_and_truncation(family: Family, monkeypatch) -> None:
    """The sampled frames' bytes are checked before any is decoded; a truncated file is a clear error or fewer
    frames, never a crash; the engine keeps serving."""
    pytest.importorskip("av")
    import flashvlm.processing.video as video

    llm = _llm(family)
    data = _encode(_clip(20, 64, 64, seed=14), fps=10)
    monkeypatch.setattr(video, "MAX_SAMPLED_BYTES", 64 * 64 * 3 * 3)
    with pytest.raises(InvalidRequestError, match="lower max_frames or fps"):
        llm.engine.process_prompt({"prompt": VIDEO, "videos": [data]})
    monkeypatch.undo()
    for cut in (len(data) // 3, 48):
        try:
            llm.engine.process_prompt({"prompt": VIDEO, "videos": [data[:cut]], "mm_processor_kwargs": KWARGS})
        except InvalidRequestError as e:
            assert "video 0" in str(e)
    assert len(llm.generate("ok", SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_video_preprocessor_config(tmp_path) -> None:
    """A checkpoint's video_preprocessor_config.json sets the defaults: fps 1 and max_frames 4 take 4 of a 10 s
    clip's frames (two temporal patches); a request still overrides them."""
    pytest.importorskip("av")
    import json

    from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

    path = build_qwen2_vl(tmp_path / "q", seed=0)
    (path / "video_preprocessor_config.json").write_text(json.dumps({"fps": 1, "max_frames": 4,
                                                                    "min_pixels": 56 * 56}))
    llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_tokens=1024)
    data = _encode(_clip(20, 56, 56, seed=15), fps=2)
    assert len(llm.engine.process_prompt({"prompt": VIDEO, "videos": [data]}).mm_items) == 2
    items = llm.engine.process_prompt({"prompt": VIDEO, "videos": [data],
                                       "mm_processor_kwargs": {"max_frames": 8}}).mm_items
    assert len(items) == 4 and items[0].num_tokens == 4  # 56x56 kept: min_pixels came from the file
