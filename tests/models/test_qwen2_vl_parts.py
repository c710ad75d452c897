"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL model parts against transformers on tiny random checkpoints (CPU, float32).

Weights are random everywhere (norms and biases included) and inputs are random, so a wrong axis,
ordering or activation shows up as a large difference rather than hiding behind zeros and ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers

from flashvlm.models.interfaces import MissingWeightError
from flashvlm.models.qwen2_vl import Qwen2VLForConditionalGeneration
from flashvlm.models.registry import resolve_model_class
from flashvlm.models.weight_utils import check_all_loaded, iterate_checkpoint
from flashvlm.request import MMItem
from flashvlm.testing.harness import single_sequence_prefill_context
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl, build_qwen3_vl
from flashvlm.testing.tiny_qwen import _legacy_qwen_layout

NUM_SPECIAL = 7  # tiny tokenizer: special tokens take the first ids

# Non-square grids of different sizes; for 2.5 (window = 2x2 merged tokens) they leave partial windows; for 3
# they are smaller and larger than its 6 x 6 position table, along each axis.
VARIANTS = {
    "qwen2_vl": dict(qwen25=False, grids=[(1, 4, 8), (1, 6, 4)]),
    "qwen2_5_vl": dict(qwen25=True, grids=[(1, 8, 12), (1, 6, 10)]),
    "qwen3_vl": dict(qwen25=False, grids=[(1, 4, 8), (1, 10, 6), (1, 8, 12)]),
}


@dataclass
class Variant:
    name: str
    path: Path
    qwen25: bool
    grids: list[tuple[int, int, int]]
    hf: transformers.PreTrainedModel
    ours: Qwen2VLForConditionalGeneration

    @property
    def patch_features(self) -> int:
        vision = self.hf.config.vision_config
        return 3 * vision.temporal_patch_size * vision.patch_size ** 2  # C * T * P * P


def _hf_class(name: str) -> type:
    return {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
            "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
            "qwen3_vl": transformers.Qwen3VLForConditionalGeneration}[name]


def _load_ours(path: Path, weights: Iterable[tuple[str, torch.Tensor]] | None = None
               ) -> Qwen2VLForConditionalGeneration:
    cfg = transformers.AutoConfig.from_pretrained(path)
    model = resolve_model_class(cfg.architectures)(cfg)
    filled = model.load_weights(iterate_checkpoint(path) if weights is None else weights)
    check_all_loaded(model, filled)
    return model.eval()


def _new_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers >= 4.52 in-memory names: model.visual.*, model.language_model.*, lm_head.*"""
    for name, t in weights:
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
            name = "model.language_model." + name[len("model."):]
        yield name, t


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Variant:
    name = request.param
    spec = VARIANTS[name]
    folder = tmp_path_factory.mktemp(name)
    path = build_qwen3_vl(folder) if name == "qwen3_vl" else build_qwen2_vl(folder, qwen25=spec["qwen25"])
    hf = _hf_class(name).from_pretrained(path, dtype=torch.float32).eval()
    return Variant(name, path, spec["qwen25"], spec["grids"], hf, _load_ours(path))


def _random_pixels(grids: list[tuple[int, int, int]], features: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t * h * w, features, generator=g) for t, h, w in grids]


def _prompt(cfg, grids: list[tuple[int, int, int]], seed: int = 1) -> tuple[list[int], list[MMItem]]:
    """text, <vision_start> image <vision_end>, text, ..., text; random text ids, placeholders expanded."""
    g = torch.Generator().manual_seed(seed)
    vision = cfg.vision_config
    pixels = _random_pixels(grids, 3 * vision.temporal_patch_size * vision.patch_size ** 2, seed)

    def text(n: int) -> list[int]:
        return torch.randint(NUM_SPECIAL, 480, (n,), generator=g).tolist()

    ids, items = text(5), []
    for i, (grid, px) in enumerate(zip(grids, pixels)):
        n = grid[0] * grid[1] * grid[2] // 4
        ids.append(cfg.vision_start_token_id)
        items.append(MMItem(mm_hash=f"img{i}", pixel_values=px, offset=len(ids), num_tokens=n, layout=grid))
        ids += [cfg.image_token_id] * n + [cfg.vision_end_token_id] + text(3 + i)
    return ids, items


def _hf_inputs(cfg, ids: list[int], items: list[MMItem]) -> dict[str, torch.Tensor]:
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, mm_token_type_ids=(input_ids == cfg.image_token_id).int(),
                pixel_values=torch.cat([it.pixel_values for it in items]),
                image_grid_thw=torch.tensor([it.layout for it in items]))


@torch.no_grad()
def _our_logits(model: Qwen2VLForConditionalGeneration, ids: list[int], items: list[MMItem]) -> torch.Tensor:
    embeds = model.embed_tokens(torch.tensor(ids))
    for item, feats in zip(items, model.encode_images(items)):
        embeds[item.offset:item.end] = feats
    positions, _ = model.prompt_positions(ids, items)
    ctx = single_sequence_prefill_context(len(ids), model.kv_cache_spec(), torch.float32)
    return model.compute_logits(model(embeds, positions, ctx))


def test_vision_tower_matches_transformers(variant: Variant) -> None:
    pixels = _random_pixels(variant.grids, variant.patch_features)
    items = [MMItem(mm_hash=str(i), pixel_values=px, num_tokens=t * h * w // 4, layout=(t, h, w))
             for i, (px, (t, h, w)) in enumerate(zip(pixels, variant.grids))]
    with torch.no_grad():
        ours = variant.ours.encode_images(items)
        ref = variant.hf.model.get_image_features(torch.cat(pixels), torch.tensor(variant.grids))
        ref = ref.pooler_output  # 5.x: a tuple of per-image tensors
    assert len(ours) == len(ref) == len(variant.grids)
    hidden = variant.hf.config.text_config.hidden_size
    for item, a, b in zip(items, ours, ref):
        assert a.shape == (item.num_tokens, variant.ours.embedding_width)
        a = a[:, :hidden]  # the embedding; Qwen3-VL's DeepStack features follow (test_deepstack_features_...)
        assert b.shape == (item.num_tokens, hidden)
        assert b.abs().max() > 0.1  # a degenerate reference would make the comparison meaningless
        assert (a - b).abs().max().item() <= 1e-5


def test_encode_rejects_placeholder_mismatch(variant: Variant) -> None:
    t, h, w = variant.grids[0]
    item = MMItem(mm_hash="bad", pixel_values=_random_pixels([(t, h, w)], variant.patch_features)[0],
                  num_tokens=t * h * w // 4 + 1,
                  layout=(t, h, w))
    with pytest.raises(ValueError, match="placeholder tokens"):
        variant.ours.encode_images([item])


def test_prompt_positions_match_get_rope_index(variant: Variant) -> None:
    cfg = variant.hf.config
    ids, items = _prompt(cfg, variant.grids)
    positions, delta = variant.ours.prompt_positions(ids, items)
    inputs = _hf_inputs(cfg, ids, items)
    ref, ref_delta = variant.hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                      image_grid_thw=inputs["image_grid_thw"])
    assert positions.dtype == torch.long and positions.shape == (3, len(ids))
    assert torch.equal(positions, ref[:, 0])
    assert delta == int(ref_delta) and delta < 0  # images compress positions, so the delta is negative


def test_text_only_prompt_positions(variant: Variant) -> None:
    positions, delta = variant.ours.prompt_positions(list(range(10, 20)), [])
    assert torch.equal(positions, torch.arange(10).expand(3, -1)) and delta == 0


def test_first_step_logits_match_transformers(variant: Variant) -> None:
    cfg = variant.hf.config
    ids, items = _prompt(cfg, variant.grids)
    ours = _our_logits(variant.ours, ids, items)
    with torch.no_grad():
        ref = variant.hf(**_hf_inputs(cfg, ids, items)).logits[0]
    assert ours.shape == ref.shape == (len(ids), cfg.text_config.vocab_size)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_new_weight_layout_gives_identical_logits(variant: Variant) -> None:
    ids, items = _prompt(variant.hf.config, variant.grids)
    weights = iterate_checkpoint(variant.path)
    # Qwen3-VL checkpoints come in the new layout: the other way round, the pre-4.52 names load too.
    renamed = _load_ours(variant.path, _legacy_qwen_layout(dict(weights)).items() if variant.name == "qwen3_vl"
                         else _new_layout(weights))
    assert torch.equal(_our_logits(renamed, ids, items), _our_logits(variant.ours, ids, items))


@pytest.mark.parametrize("qwen25", [False, True], ids=["qwen2_vl", "qwen2_5_vl"])
def test_tied_legacy_checkpoint_both_layouts(qwen25: bool, tmp_path: Path) -> None:
    path = build_qwen2_vl(tmp_path / "tied", qwen25=qwen25, legacy_layout=True, tie_word_embeddings=True,
                          seed=3)
    names = [name for name, _ in iterate_checkpoint(path)]
    assert "lm_head.weight" not in names and any(n.startswith("visual.") for n in names)
    legacy = _load_ours(path)
    assert legacy.lm_head is None
    # The new layout, with an lm_head copy as some tied checkpoints carry: it must be ignored.
    extra = [("lm_head.weight", torch.randn(512, 64))]
    new = _load_ours(path, _new_layout([*iterate_checkpoint(path), *extra]))
    grids = VARIANTS["qwen2_5_vl" if qwen25 else "qwen2_vl"]["grids"]
    hf = _hf_class("qwen2_5_vl" if qwen25 else "qwen2_vl").from_pretrained(path, dtype=torch.float32).eval()
    ids, items = _prompt(hf.config, grids, seed=5)
    a, b = _our_logits(legacy, ids, items), _our_logits(new, ids, items)
    assert torch.equal(a, b)
    with torch.no_grad():
        ref = hf(**_hf_inputs(hf.config, ids, items)).logits[0]
    assert (a - ref).abs().max().item() <= 1e-4


_DROPPED = {
    # checkpoint tensor -> the parameter the error must name
    "model.layers.1.self_attn.k_proj.bias": "language_model.layers.1.self_attn.qkv_proj.bias",
    "model.norm.weight": "language_model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "visual.blocks.0.attn.qkv.weight": "visual.blocks.0.attn.qkv.weight",
    "visual.patch_embed.proj.weight": "visual.patch_embed.proj.weight",
    "visual.merger.mlp.2.bias": "visual.merger.mlp.2.bias",
}
_DROPPED_25 = {"visual.blocks.1.mlp.up_proj.bias": "visual.blocks.1.mlp.gate_up_proj.bias"}
_DROPPED_2 = {"visual.blocks.1.mlp.fc1.bias": "visual.blocks.1.mlp.fc1.bias",
              "visual.merger.ln_q.bias": "visual.merger.ln_q.bias"}
_DROPPED_3 = {  # new-layout names, as Qwen3-VL checkpoints carry
    "model.language_model.layers.1.self_attn.k_norm.weight": "language_model.layers.1.self_attn.k_norm.weight",
    "model.language_model.layers.0.self_attn.v_proj.weight": "language_model.layers.0.self_attn.qkv_proj.weight",
    "lm_head.weight": "lm_head.weight",
    "model.visual.patch_embed.proj.bias": "visual.patch_embed.proj.bias",
    "model.visual.pos_embed.weight": "visual.pos_embed.weight",
    "model.visual.blocks.2.mlp.linear_fc1.weight": "visual.blocks.2.mlp.linear_fc1.weight",
    "model.visual.merger.norm.bias": "visual.merger.norm.bias",
    "model.visual.deepstack_merger_list.1.linear_fc2.bias": "visual.deepstack_merger_list.1.linear_fc2.bias",
}


def test_missing_tensor_is_named(variant: Variant) -> None:
    if variant.name == "qwen3_vl":
        dropped = _DROPPED_3
    else:
        dropped = {**_DROPPED, **(_DROPPED_25 if variant.qwen25 else _DROPPED_2)}
    for ckpt_name, param_name in dropped.items():
        weights = [(n, t) for n, t in iterate_checkpoint(variant.path) if n != ckpt_name]
        assert len(weights) == len(list(iterate_checkpoint(variant.path))) - 1, ckpt_name
        with pytest.raises(MissingWeightError, match=r"1 weight tensor\(s\): " + re.escape(param_name) + "$"):
            _load_ours(variant.path, weights)
