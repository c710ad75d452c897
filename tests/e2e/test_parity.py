"""Engine vs transformers on the same tiny checkpoints (float32, CPU): greedy tokens and first-step logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.request import InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_fuyu, build_llava, build_llava_next, build_qwen2_vl, build_qwen3_vl

# "demo" is the shipped demo checkpoint (flashvlm/demo/checkpoint): trained weights, a Qwen2-VL architecture.
FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "demo", "fuyu"]
PLACEHOLDER = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
               "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>\n",
               "llava_next": "<image>\n", "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
               "demo": "<|vision_start|><|image_pad|><|vision_end|>", "fuyu": "|SPEAKER|"}
MAX_IMAGES = {"fuyu": 1}
"""Families whose HF processor takes fewer images a prompt (FuyuProcessor: one); the engine refuses more."""
MAX_TOKENS = 10


def _image(w: int, h: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


class Family:
    """A tiny checkpoint of one family, its transformers reference, and helpers to run both."""

    def __init__(self, name: str, path) -> None:
        from transformers import AutoConfig

        from flashvlm.models.registry import resolve_family

        self.name, self.path = name, str(path)
        self.config = AutoConfig.from_pretrained(self.path)
        self.entry = resolve_family(self.config.architectures)
        """The family's registry entry: its transformers class and the image arguments that class takes."""
        self.hf = self.entry.baseline_model_class().from_pretrained(self.path, dtype=torch.float32).eval()
        self.max_images = MAX_IMAGES.get(name, 16)

    def images(self, n: int) -> int:
        """n, or as many as the family's processor takes (its refusal of more has its own test)."""
        return min(n, self.max_images)

    def prompt(self, text: str, n_images: int, sizes=((56, 112), (140, 84))) -> dict:
        images = [_image(*sizes[i % len(sizes)], seed=i + len(text)) for i in range(n_images)]
        return {"prompt": PLACEHOLDER[self.name] * n_images + text, "images": images}

    def hf_inputs(self, llm: LLM, prompt: dict) -> dict:
        processed = llm.engine.process_prompt(prompt)
        ids = torch.tensor([processed.prompt_token_ids])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if processed.mm_items:
            inputs.update(self.entry.baseline_image_inputs(processed.mm_items, ids, inputs["attention_mask"],
                                                           llm.engine.model.image_token_id, "cpu"))
        return inputs

    @torch.inference_mode()
    def hf_generate(self, llm: LLM, prompt: dict, params: SamplingParams) -> tuple[list[int], torch.Tensor]:
        from transformers import GenerationConfig

        inputs = self.hf_inputs(llm, prompt)
        first_logits = self.hf(**inputs).logits[0, -1]
        eos = set() if params.ignore_eos else set(llm.engine.eos_token_ids)
        config = GenerationConfig(max_new_tokens=params.max_tokens, do_sample=False,
                                  eos_token_id=sorted(eos) or None, pad_token_id=0)
        # transformers falls back on the checkpoint's own generation_config.json for an unset eos: with
        # ignore_eos that one must not stop it either.
        saved, self.hf.generation_config.eos_token_id = self.hf.generation_config.eos_token_id, None
        try:
            out = self.hf.generate(**inputs, generation_config=config)
        finally:
            self.hf.generation_config.eos_token_id = saved
        tokens = out[0, inputs["input_ids"].shape[1]:].tolist()
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[: i + 1], first_logits
        return tokens, first_logits


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> Family:
    if request.param == "demo":
        from flashvlm.models.default import default_model_path

        return Family("demo", default_model_path())
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llava":
        build_llava(path, seed=3)
    elif request.param == "llava_next":
        build_llava_next(path, seed=3)
    elif request.param == "qwen3_vl":
        build_qwen3_vl(path, seed=3)
    elif request.param == "fuyu":
        build_fuyu(path, seed=3)
    else:
        build_qwen2_vl(path, qwen25=request.param == "qwen2_5_vl", seed=3)
    return Family(request.param, path)


def _llm(family: Family, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    return LLM(family.path, device="cpu", dtype="float32", **kw)


def _check(family: Family, llm: LLM, prompts: list[dict], params: SamplingParams | None = None) -> list:
    llm.engine.runner.record_logits = True
    llm.engine.runner.recorded_logits.clear()
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        expected, hf_logits = family.hf_generate(llm, prompt, params)
        assert out.token_ids == expected, f"{family.name}: ours {out.token_ids} != transformers {expected}"
        ours = llm.engine.runner.recorded_logits[out.request_id][0]
        assert (ours - hf_logits).abs().max().item() <= 1e-4
    return outs


def test_single_image(family: Family) -> None:
    _check(family, _llm(family), [family.prompt("Describe the image.", 1)])


def test_two_images_non_square(family: Family) -> None:
    if family.max_images < 2:
        with pytest.raises(InvalidRequestError, match="at most 1"):
            _llm(family).generate([family.prompt("Compare them.", 2)], SamplingParams(max_tokens=2))
        return
    _check(family, _llm(family), [family.prompt("Compare them.", 2, sizes=((56, 112), (140, 84)))])


def test_aspects(family: Family) -> None:
    """Wide, tall and landscape pictures in one prompt: LLaVA-NeXT picks a different tile grid for each and drops
    different padding rows or columns; Qwen's grids differ."""
    sizes = ((250, 60), (60, 170), (200, 150))
    _check(family, _llm(family), [family.prompt("Which is widest?", family.images(3), sizes=sizes)])


def test_large_image_resized(family: Family) -> None:
    """Larger than every tiny processor's target: Qwen shrinks it, LLaVA crops it, Fuyu fits it into its canvas."""
    _check(family, _llm(family), [family.prompt("What is it?", 1, sizes=((300, 200),))])


def test_text_only(family: Family) -> None:
    _check(family, _llm(family), [{"prompt": "How many triangles are in the picture?"}])


def test_mixed_batch_of_eight(family: Family) -> None:
    texts = ["Hi.", "What colour is the shape?", "The quick brown fox jumps over the lazy dog. " * 3, "yes no"]
    prompts = [family.prompt(texts[i % 4], n_images=family.images(i % 3), sizes=((56, 56), (84, 140), (112, 56)))
               for i in range(8)]
    _check(family, _llm(family), prompts)


def test_chunked_prefill(family: Family) -> None:
    # Fuyu, one image a prompt: 140x84 is 18 tokens, more than a step's budget of 16.
    first = family.prompt("Describe both pictures in detail.", family.images(2), sizes=((140, 84), (56, 112)))
    prompts = [first, family.prompt("Short.", 1)]
    _check(family, _llm(family, max_num_batched_tokens=16), prompts)


def test_preemption(family: Family) -> None:
    prompts = [family.prompt(f"Question number {i}: what is shown?", 1, sizes=((84, 84),)) for i in range(6)]
    # Blocks of 16 tokens for one request's prompt and 20 new tokens (6 where the image takes < 64 tokens;
    # LLaVA-NeXT's tiles take more): one request alone fits, two growing side by side do not.
    probe = _llm(family)
    longest = max(len(probe.engine.process_prompt(p).prompt_token_ids) for p in prompts) + 20
    llm = _llm(family, kv_cache_tokens=max(96, 16 * -(-longest // 16)), block_size=16, max_num_batched_tokens=64)
    _check(family, llm, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.scheduler.block_manager.num_usable_blocks
