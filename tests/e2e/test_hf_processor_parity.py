"""Our prompt processing against HF's own processor, loaded from the same checkpoint folder: token ids after
placeholder expansion and chat templating, pixel values and Qwen's image grids.

test_parity.py hands transformers our processed inputs, so it cannot notice a difference in these steps.
The processors are built from HF's PIL image processors (see _hf_processor), with or without torchvision.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from flashvlm import LLM
from flashvlm.request import InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_fuyu, build_llava, build_llava_next, build_qwen2_vl, build_qwen3_vl

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "fuyu"]
PLACEHOLDER = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
               "qwen2_5_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>\n",
               "llava_next": "<image>\n", "qwen3_vl": "<|vision_start|><|image_pad|><|vision_end|>",
               "fuyu": "|SPEAKER|"}
BARE_PLACEHOLDER = {"qwen2_vl": "<|image_pad|>", "qwen2_5_vl": "<|image_pad|>", "qwen3_vl": "<|image_pad|>",
                    "llava": "<image>", "llava_next": "<image>"}
# (width, height): one kept as it is, one resized up, one resized down (Qwen) or cropped (LLaVA); for LLaVA-NeXT
# three tile grids, each with padding rows or columns dropped
SIZES = ((56, 112), (80, 60), (300, 200))


def _image(size: tuple[int, int], seed: int) -> np.ndarray:
    width, height = size
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _video_processor_stand_in(monkeypatch: pytest.MonkeyPatch):
    """Qwen's HF processors type-check a video processor, which images never touch. Without torchvision that
    class cannot be built, so the stand-in is an instance of the base class the check asks for, made without
    its constructor. transformers up to 5.18 checks BaseVideoProcessor, exported as a placeholder without
    torchvision; from 5.19 it checks VideoProcessorMixin, which it then leaves out of its namespace and so
    fails to look up, hence the class is put where the check looks for it while the processor is built."""
    import transformers
    from transformers import processing_utils

    name = processing_utils.MODALITY_TO_BASE_CLASS_MAPPING["video_processor"]
    base = getattr(transformers, name, None)
    if base is None:
        from transformers import video_processing_utils

        base = getattr(video_processing_utils, name)
        monkeypatch.setattr(transformers, name, base, raising=False)
    return object.__new__(base)


def _hf_processor(name: str, path, hf_config):
    """HF's processor with its PIL image processor, which is what we match (the torchvision "fast" ones resize
    differently and AutoProcessor picks them wherever torchvision is installed, e.g. on the GPU machine)."""
    from transformers import (
        AutoTokenizer,
        LlavaNextProcessor,
        LlavaProcessor,
        Qwen2_5_VLProcessor,
        Qwen2VLProcessor,
        Qwen3VLProcessor,
    )
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(path)
    if name == "llava_next":
        return LlavaNextProcessor(image_processor=LlavaNextImageProcessorPil.from_pretrained(path),
                                  tokenizer=tokenizer, chat_template=tokenizer.chat_template,
                                  patch_size=hf_config.vision_config.patch_size,
                                  vision_feature_select_strategy=hf_config.vision_feature_select_strategy,
                                  num_additional_image_tokens=1)
    if name == "fuyu":
        from transformers import FuyuProcessor
        from transformers.models.fuyu.image_processing_pil_fuyu import FuyuImageProcessorPil

        class PilFuyu(FuyuImageProcessorPil):
            """5.24's PIL patchify takes numpy only, yet FuyuProcessor hands it torch tensors (5.17's takes both)."""

            def patchify_image(self, image, patch_size=None):
                if isinstance(image, torch.Tensor):
                    image = image.numpy()
                return torch.from_numpy(np.ascontiguousarray(super().patchify_image(image, patch_size)))

        return FuyuProcessor(image_processor=PilFuyu.from_pretrained(path), tokenizer=tokenizer)
    if name == "llava":
        # llava-hf folders carry these in processor_config.json; the tiny checkpoint has none, and without
        # patch_size HF leaves <image> unexpanded.
        return LlavaProcessor(image_processor=LlavaImageProcessorPil.from_pretrained(path), tokenizer=tokenizer,
                              chat_template=tokenizer.chat_template, patch_size=hf_config.vision_config.patch_size,
                              vision_feature_select_strategy=hf_config.vision_feature_select_strategy,
                              num_additional_image_tokens=1)
    cls = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}.get(name, Qwen2VLProcessor)
    with pytest.MonkeyPatch.context() as monkeypatch:
        return cls(image_processor=Qwen2VLImageProcessorPil.from_pretrained(path), tokenizer=tokenizer,
                   video_processor=_video_processor_stand_in(monkeypatch), chat_template=tokenizer.chat_template)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    # LLaVA's tokenizer adds <s> as llava-hf's do, and its chat template writes none (the BOS case of
    # test_chat_matches_hf_processor).
    if name == "fuyu":
        path = build_fuyu(folder, seed=31)
    elif name == "llava_next":
        path = build_llava_next(folder, seed=31)  # its tokenizer adds <s> too
    elif name == "llava":
        path = build_llava(folder, seed=31, add_bos=True)
    elif name == "qwen3_vl":
        path = build_qwen3_vl(folder, seed=31)
    else:
        path = build_qwen2_vl(folder, seed=31, qwen25=name == "qwen2_5_vl")
    llm = LLM(str(path), device="cpu", kv_cache_tokens=1024)
    return name, llm, _hf_processor(name, path, llm.engine.model.config)


def _assert_same(name: str, ours, hf) -> None:
    assert ours.prompt_token_ids == hf["input_ids"][0].tolist()
    items = ours.mm_items
    if not items:
        assert "pixel_values" not in hf and "image_patches" not in hf
        return
    if name == "fuyu":
        pixels = torch.cat([it.model_pixels() for it in items])
        assert sum(rows * cols for rows, cols in (it.layout for it in items)) == pixels.shape[0]
        hf = {"pixel_values": hf["image_patches"].reshape(pixels.shape[0], -1)}
    elif name == "llava_next":
        # HF pads a batch's images to one crop count with zeros; each of ours has its own.
        assert [[it.image_size[1], it.image_size[0]] for it in items] == hf["image_sizes"].tolist()
        for i, it in enumerate(items):
            n = it.pixel_values.shape[0]
            torch.testing.assert_close(it.pixel_values, hf["pixel_values"][i, :n], atol=1e-5, rtol=0)
            assert not hf["pixel_values"][i, n:].any()
        return
    elif name == "llava":
        pixels = torch.stack([torch.as_tensor(it.pixel_values) for it in items])
    else:
        pixels = torch.cat([it.model_pixels() for it in items])
        assert [list(it.layout) for it in items] == hf["image_grid_thw"].tolist()
        if "mm_token_type_ids" in hf:  # Qwen3-VL's processor marks the image placeholders, which ours span
            marks = [0] * len(ours.prompt_token_ids)
            for it in items:
                marks[it.offset:it.end] = [1] * (it.end - it.offset)
            assert hf["mm_token_type_ids"][0].tolist() == marks
    assert pixels.shape == hf["pixel_values"].shape
    torch.testing.assert_close(pixels, hf["pixel_values"].to(pixels.dtype), atol=1e-2, rtol=0)


@pytest.mark.parametrize("case", ["one_image", "large_image", "text_only", "two_sizes", "adjacent"])
def test_raw_prompt_matches_hf_processor(family, case) -> None:
    name, llm, hf_processor = family
    if name == "fuyu" and case in ("two_sizes", "adjacent"):
        pytest.skip("FuyuProcessor takes one image a prompt (test_parity checks the engine refuses more)")
    if case == "one_image":
        text, sizes = PLACEHOLDER[name] + "What is this?", SIZES[1:2]
    elif case == "large_image":
        text, sizes = PLACEHOLDER[name] + "What is this?", SIZES[2:]
    elif case == "text_only":
        text, sizes = "What is this?", ()
    elif case == "two_sizes":
        text, sizes = PLACEHOLDER[name] + "left, right: " + PLACEHOLDER[name] + "compare", SIZES[:2]
    else:
        text, sizes = BARE_PLACEHOLDER[name] * 3 + " compare", SIZES
    images = [_image(size, seed) for seed, size in enumerate(sizes)]
    ours = llm.engine.process_prompt({"prompt": text, "images": images})
    # FuyuProcessor puts the image in front of the text itself; our raw prompt may name its place.
    hf_text = text.removeprefix(PLACEHOLDER[name]) if name == "fuyu" else text
    hf = hf_processor(text=hf_text, images=[Image.fromarray(a) for a in images] or None, return_tensors="pt")
    _assert_same(name, ours, hf)
    # HF's ids, already expanded, given as token ids with the same pictures: taken as they are.
    again = llm.engine.process_prompt({"prompt_token_ids": hf["input_ids"][0].tolist(), "images": images})
    assert again.prompt_token_ids == ours.prompt_token_ids
    assert [it.offset for it in again.mm_items] == [it.offset for it in ours.mm_items]
    if name == "fuyu" and images:  # the text alone, without the placeholder, is the same prompt
        assert llm.engine.process_prompt({"prompt": hf_text, "images": images}).prompt_token_ids == \
            ours.prompt_token_ids


def test_chat_matches_hf_processor(family) -> None:
    """The processor's own apply_chat_template, tokenized: it adds the tokenizer's BOS where the template writes
    none (LLaVA here), so ours must too."""
    name, llm, hf_processor = family
    if name == "fuyu":  # adept/fuyu-8b ships no chat template, nor does FuyuProcessor
        with pytest.raises(InvalidRequestError, match="no chat template"):
            llm.engine.process_chat([{"role": "user", "content": "hi"}])
        return
    images = [_image(size, 10 + seed) for seed, size in enumerate(SIZES[:2])]
    content = [{"type": "text", "text": "Two pictures:"}, {"type": "image"}, {"type": "image"},
               {"type": "text", "text": "Which is brighter?"}]
    hf_content = [part if part["type"] == "text" else {"type": "image", "image": Image.fromarray(images[i // 2])}
                  for i, part in enumerate(content)]
    hf = hf_processor.apply_chat_template([{"role": "user", "content": hf_content}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True, return_tensors="pt")
    ours_content = [part if part["type"] == "text" else {"type": "image", "image": images.pop(0)}
                    for part in content]
    ours = llm.engine.process_chat([{"role": "user", "content": ours_content}])
    if name.startswith("llava"):
        assert ours.prompt_token_ids[0] == llm.engine.input_processor.tokenizer.bos_token_id
    _assert_same(name, ours, hf)
