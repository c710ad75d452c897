"""LLaVA-1.5 parts against transformers on a tiny random checkpoint: image features, prefill logits,
both checkpoint layouts, and missing-weight errors."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from flashvlm.models.interfaces import MissingWeightError
from flashvlm.models.llava import LlavaForConditionalGeneration
from flashvlm.models.weight_utils import check_all_loaded, iterate_checkpoint
from flashvlm.request import MMItem
from flashvlm.testing.harness import single_sequence_prefill_context
from flashvlm.testing.tiny_checkpoints import build_llava

IMAGE_SIZE = 56
PATCHES = (IMAGE_SIZE // 14) ** 2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava"), image_size=IMAGE_SIZE)


@pytest.fixture(scope="module")
def hf_model(ckpt: Path) -> transformers.LlavaForConditionalGeneration:
    return transformers.LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def config(ckpt: Path) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.from_pretrained(ckpt)


def build_ours(config, weights) -> LlavaForConditionalGeneration:
    model = LlavaForConditionalGeneration(config).eval()
    check_all_loaded(model, model.load_weights(weights))
    return model


def random_images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


def items_for(pixels: torch.Tensor, offsets: list[int], num_tokens: int) -> list[MMItem]:
    return [MMItem(mm_hash=f"img{i}", pixel_values=p, offset=o, num_tokens=num_tokens)
            for i, (p, o) in enumerate(zip(pixels, offsets))]


def hf_features(hf, pixels: torch.Tensor, layer, strategy: str) -> torch.Tensor:
    out = hf.model.get_image_features(pixel_values=pixels, vision_feature_layer=layer,
                                      vision_feature_select_strategy=strategy)
    return torch.stack(list(out.pooler_output))


@pytest.mark.parametrize(("layer", "strategy", "built_layers"),
                         [(-2, "default", 2), (-1, "default", 3), (-2, "full", 2), (1, "full", 1)])
@torch.inference_mode()
def test_image_features_match_hf(ckpt, hf_model, config, layer: int, strategy: str,
                                 built_layers: int) -> None:
    cfg = copy.deepcopy(config)
    cfg.vision_feature_layer, cfg.vision_feature_select_strategy = layer, strategy
    ours = build_ours(cfg, iterate_checkpoint(ckpt))
    # Layers past the requested one are neither built nor run.
    assert len(ours.vision_tower.encoder.layers) == built_layers
    pixels = random_images(2)
    tokens = PATCHES + (strategy == "full")
    got = torch.stack(ours.encode_images(items_for(pixels, [0, 0], tokens)))
    want = hf_features(hf_model, pixels, layer, strategy)
    assert got.shape == want.shape == (2, tokens, config.text_config.hidden_size)
    assert (got - want).abs().max().item() <= 1e-5


@torch.inference_mode()
def test_feature_layer_list_concatenates(config) -> None:
    cfg = copy.deepcopy(config)
    cfg.vision_feature_layer = [-3, -1]
    torch.manual_seed(1)
    hf = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF zero-inits biases and ones norms; random values make the test able to fail
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # The in-memory state dict carries the transformers-5 names (model.vision_tower.* ...).
    ours = build_ours(cfg, hf.state_dict().items())
    pixels = random_images(2, seed=3)
    got = torch.stack(ours.encode_images(items_for(pixels, [0, 0], PATCHES)))
    want = hf_features(hf, pixels, [-3, -1], "default")
    assert (got - want).abs().max().item() <= 1e-5


def prompt_with_two_images(seed: int = 0) -> tuple[torch.Tensor, list[int], int]:
    """bos, text, <image>*16, text, <image>*16, text: returns (ids, image offsets, image token id)."""
    g = torch.Generator().manual_seed(seed)
    image_id = 3
    text = [torch.randint(5, 512, (n,), generator=g) for n in (6, 4, 5)]
    img = torch.full((PATCHES,), image_id)
    ids = torch.cat([torch.tensor([1]), text[0], img, text[1], img, text[2]])
    first = 1 + len(text[0])
    return ids, [first, first + PATCHES + len(text[1])], image_id


@torch.inference_mode()
def our_prefill_logits(model: LlavaForConditionalGeneration, ids: torch.Tensor,
                       items: list[MMItem]) -> torch.Tensor:
    embeds = model.embed_tokens(ids)
    for item, feats in zip(items, model.encode_images(items)):
        embeds[item.offset:item.end] = feats
    positions, delta = model.prompt_positions(ids.tolist(), items)
    assert delta == 0
    ctx = single_sequence_prefill_context(len(ids), model.kv_cache_spec(), torch.float32)
    return model.compute_logits(model(embeds, positions, ctx))


@torch.inference_mode()
def test_prefill_logits_match_hf(ckpt, hf_model, config) -> None:
    ours = build_ours(config, iterate_checkpoint(ckpt))
    ids, offsets, image_id = prompt_with_two_images()
    assert ours.image_token_id == image_id and not ours.uses_mrope
    pixels = random_images(2, seed=5)
    got = our_prefill_logits(ours, ids, items_for(pixels, offsets, PATCHES))
    want = hf_model(input_ids=ids[None], pixel_values=pixels).logits[0]
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4


def canonical_name(name: str) -> str:
    """Any llava-hf layout -> the transformers-5 names."""
    for old, new in (("language_model.model.", "model.language_model."),
                     ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.vision_model.", "model.vision_tower."),
                     ("vision_tower.", "model.vision_tower."),
                     ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name


def hub_name(name: str) -> str:
    """transformers-5 names -> the layout of llava-hf hub checkpoints (vision_tower.vision_model.*)."""
    for new, old in (("model.language_model.", "language_model.model."),
                     ("lm_head.", "language_model.lm_head."),
                     ("model.vision_tower.", "vision_tower.vision_model."),
                     ("model.multi_modal_projector.", "multi_modal_projector.")):
        if name.startswith(new):
            return old + name[len(new):]
    raise AssertionError(f"unexpected name {name}")


@torch.inference_mode()
def test_checkpoint_layouts_load_identically(ckpt, config, tmp_path: Path) -> None:
    saved = {canonical_name(n): t for n, t in iterate_checkpoint(ckpt)}
    layouts = {"transformers5": saved, "hub": {hub_name(n): t for n, t in saved.items()}}
    ids, offsets, _ = prompt_with_two_images(seed=1)
    items = items_for(random_images(2, seed=7), offsets, PATCHES)
    base = our_prefill_logits(build_ours(config, iterate_checkpoint(ckpt)), ids, items)
    for layout, state in layouts.items():
        folder = tmp_path / layout
        folder.mkdir()
        save_file({n: t.contiguous() for n, t in state.items()}, str(folder / "model.safetensors"))
        got = our_prefill_logits(build_ours(config, iterate_checkpoint(folder)), ids, items)
        assert torch.equal(got, base), layout


@pytest.mark.parametrize(("dropped_suffix", "param"), [
    ("multi_modal_projector.linear_2.weight", "multi_modal_projector.linear_2.weight"),
    ("encoder.layers.1.self_attn.k_proj.bias", "vision_tower.encoder.layers.1.self_attn.qkv_proj.bias"),
    ("layers.0.mlp.up_proj.weight", "language_model.layers.0.mlp.gate_up_proj.weight"),
    ("lm_head.weight", "lm_head.weight"),
])
def test_missing_tensor_is_named(ckpt, config, dropped_suffix: str, param: str) -> None:
    weights = list(iterate_checkpoint(ckpt))
    kept = [(n, t) for n, t in weights if not n.endswith(dropped_suffix)]
    assert len(kept) == len(weights) - 1
    with pytest.raises(MissingWeightError, match=param.replace(".", r"\.")):
        build_ours(config, kept)


def test_tied_embeddings_use_embed_weight(config) -> None:
    cfg = copy.deepcopy(config)
    cfg.tie_word_embeddings = True
    model = LlavaForConditionalGeneration(cfg)
    assert model.lm_head is None and "lm_head.weight" not in dict(model.named_parameters())
    hidden = torch.randn(3, cfg.text_config.hidden_size)
    want = hidden @ model.language_model.embed_tokens.weight.T
    assert torch.allclose(model.compute_logits(hidden), want)


def test_bad_inputs_are_refused(ckpt, config) -> None:
    model = build_ours(config, iterate_checkpoint(ckpt))
    wrong_count = items_for(random_images(1), [0], PATCHES + 1)
    with pytest.raises(ValueError, match="placeholder tokens"):
        model.encode_images(wrong_count)
    mixed = items_for(random_images(1), [0], PATCHES) + \
        [MMItem(mm_hash="small", pixel_values=torch.zeros(3, 28, 28), num_tokens=PATCHES)]
    with pytest.raises(ValueError, match=r"small: pixel_values shape \(3, 28, 28\)"):
        model.encode_images(mixed)
    with pytest.raises(ValueError, match="expects 56x56"):  # the tower itself, called directly
        model.vision_tower(torch.zeros(1, 3, 28, 28))
    assert model.encode_images([]) == []
