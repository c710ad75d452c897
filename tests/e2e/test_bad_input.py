"""Bad input gets a clear exception naming the problem, and the engine keeps serving the next request."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
from PIL import Image

from flashvlm import LLM, InvalidRequestError, SamplingParams
from flashvlm.config import ConfigError
from flashvlm.models.interfaces import MissingWeightError
from flashvlm.models.registry import UnsupportedModelError
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen"), seed=5)


@pytest.fixture(scope="module")
def llm(ckpt) -> LLM:
    return LLM(str(ckpt), device="cpu", max_model_len=256, kv_cache_tokens=2048)


def _image(w: int = 56, h: int = 56) -> np.ndarray:
    return np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _still_works(llm: LLM) -> None:
    out = llm.generate({"prompt": IMG + "still ok?", "images": [_image()]}, SamplingParams(max_tokens=3))[0]
    assert out.finish_reason in ("stop", "length") and len(out.token_ids) >= 1
    assert not llm.engine.has_unfinished_requests()
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_image()).save(buf, format="PNG")
    return buf.getvalue()


BAD_PROMPTS = [
    ({"prompt": "word " * 400}, "max_model_len"),
    ({"prompt": IMG + IMG + "two placeholders", "images": [_image()]}, "placeholder"),
    ({"prompt": "no placeholder", "images": [_image()]}, "placeholder"),
    ({"prompt": IMG, "images": [b"\x89PNG\r\n\x1a\n-corrupt"]}, "image 0"),
    ({"prompt": IMG, "images": [_png_bytes()[:60]]}, "image 0"),
    ({"prompt": IMG, "images": [np.zeros((0, 10, 3), dtype=np.uint8)]}, "zero"),
    ({"prompt": IMG, "images": [Image.new("HSV", (32, 32))]}, "mode"),
    ({"prompt": IMG, "images": ["data:image/png;base64,!!!notbase64"]}, "base64"),
    ({"prompt": IMG, "images": ["/nonexistent/picture.png"]}, "not found"),
    ({"prompt_token_ids": [1, 2, 10**7]}, "vocabulary"),
    ({"prompt": ""}, "empty"),
    ({"text": "wrong key"}, "unknown prompt field"),
]


@pytest.mark.parametrize("prompt,needle", BAD_PROMPTS, ids=[n for _, n in BAD_PROMPTS])
def test_bad_prompt(llm: LLM, prompt: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([{"prompt": "a good prompt queued first"}, prompt], SamplingParams(max_tokens=2))
    assert needle.lower() in str(e.value).lower()
    _still_works(llm)


def test_bad_prompt_amid_good_ones_aborts_the_batch(llm: LLM) -> None:
    """Prompts are preprocessed on threads while the first ones already run: a bad one in the middle of a
    batch raises, the good ones already added are aborted, and nothing is left held."""
    good = {"prompt": IMG + "fine", "images": [_image()]}
    bad = {"prompt": IMG, "images": [b"\x89PNG\r\n\x1a\n-corrupt"]}
    with pytest.raises(InvalidRequestError, match="image 0"):
        llm.generate([good, good, bad, good], SamplingParams(max_tokens=50, ignore_eos=True))
    _still_works(llm)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"), (dict(top_k=-5), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=50, max_tokens=5), "min_tokens"),
])
def test_bad_sampling_params(llm: LLM, kwargs: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)
    # Fields set after construction reach the engine unchecked by the constructor: the engine checks again.
    params = SamplingParams()
    for key, value in kwargs.items():
        setattr(params, key, value)
    with pytest.raises(InvalidRequestError, match=needle):
        llm.generate([{"prompt": "a good prompt"}, {"prompt": "a bad one"}], [SamplingParams(max_tokens=2), params])
    with pytest.raises(InvalidRequestError, match=needle):
        llm.engine.add_request({"prompt": "a bad one"}, params)
    _still_works(llm)


def test_failed_vision_step_does_not_poison_its_image(llm: LLM, monkeypatch) -> None:
    """A step that fails inside the vision tower (e.g. out of memory) fails its requests; the next request with
    the same image encodes it again instead of finding a cache entry with no embedding behind it."""
    prompt = {"prompt": IMG + "what is this?", "images": [_image(84, 112)]}  # a picture no other test sends
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    model, real = llm.engine.model, llm.engine.model.encode_images
    failures = []

    def fail_once(items):
        if not failures:
            failures.append(1)
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(items)

    monkeypatch.setattr(model, "encode_images", fail_once)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(prompt, params)
    assert failures == [1]
    retried = llm.generate(prompt, params)[0].token_ids
    assert len(retried) == 4 and llm.generate(prompt, params)[0].token_ids == retried  # the latter from caches
    enc = llm.engine.scheduler.encoder_cache
    enc.check_invariants()
    assert enc.held_hashes() <= llm.engine.runner.encoder_outputs.keys()
    _still_works(llm)


def test_bad_chat_parts(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="unsupported content part type 'audio'"):
        llm.chat([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}])
    with pytest.raises(InvalidRequestError, match="http"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    _still_works(llm)


def test_unknown_architecture(ckpt, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["MadeUpForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MadeUpForCausalLM"):
        LLM(str(bad), device="cpu")


def test_missing_weight_is_named(ckpt, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "missing"
    shutil.copytree(ckpt, bad)
    state = load_file(str(bad / "model.safetensors"))
    victim = next(k for k in state if "post_attention_layernorm" in k)
    del state[victim]
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(MissingWeightError, match="post_attention_layernorm"):
        LLM(str(bad), device="cpu")


def test_not_a_checkpoint(tmp_path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("tokens,stop,text", [
    # The token that reaches max_tokens also completes the stop string: the stop string wins, as in vLLM.
    (["a", "e"], "e", "a"),
    # The last token ends mid-character ("Ã" is byte 0xC3), so its text is held back until the request finishes;
    # the flush then completes the stop string: the text is cut and the outcome is "stop", not "length".
    (["e", "Ã"], "e\ufffd", ""),
], ids=["same-token", "at-the-flush"])
def test_stop_string_on_the_last_allowed_token_reports_stop(llm: LLM, monkeypatch, tokens: list[str], stop: str,
                                                            text: str) -> None:
    script = iter(llm.engine.tokenizer.convert_tokens_to_ids(tokens))
    monkeypatch.setattr(llm.engine.runner, "execute",
                        lambda out: {s.request.request_id: next(script) for s in out.scheduled if s.samples})
    out = llm.generate({"prompt": "say e"}, SamplingParams(max_tokens=2, ignore_eos=True, stop=[stop]))[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text, "stop", stop)
    monkeypatch.undo()
    _still_works(llm)
