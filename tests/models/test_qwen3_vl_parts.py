"""What Qwen3-VL adds to the Qwen2-VL parts (test_qwen2_vl_parts.py runs the shared checks on it too): the DeepStack
features against transformers', the interleaved M-RoPE, the decoder's input width, and the MoE variant refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from flashvlm.layers.rotary import MRotaryEmbedding
from flashvlm.models.qwen3_vl import Qwen3VLForConditionalGeneration
from flashvlm.models.registry import UnsupportedModelError, resolve_family
from flashvlm.models.weight_utils import check_all_loaded, iterate_checkpoint
from flashvlm.request import MMItem
from flashvlm.testing.harness import single_sequence_prefill_context
from flashvlm.testing.tiny_checkpoints import build_qwen3_vl

GRIDS = [(1, 4, 8), (1, 10, 6), (1, 8, 12)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, transformers.PreTrainedModel, Qwen3VLForConditionalGeneration]:
    path = build_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), seed=5, deepstack=(2, 0))  # out of block order
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ours = Qwen3VLForConditionalGeneration(hf.config)
    check_all_loaded(ours, ours.load_weights(iterate_checkpoint(path)))
    return path, hf, ours.eval()


def _items(seed: int = 0) -> list[MMItem]:
    g = torch.Generator().manual_seed(seed)
    return [MMItem(mm_hash=str(i), pixel_values=torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=g),
                   num_tokens=t * h * w // 4, layout=(t, h, w)) for i, (t, h, w) in enumerate(GRIDS)]


@torch.no_grad()
def test_deepstack_features_match_transformers(pair) -> None:
    _, hf, ours = pair
    items = _items()
    rows = ours.encode_images(items)
    ref = hf.model.visual(torch.cat([it.pixel_values for it in items]), grid_thw=torch.tensor(GRIDS))
    hidden = hf.config.text_config.hidden_size
    assert ours.embedding_width == hidden * 3 and len(ref.deepstack_features) == 2
    ours_all = torch.cat(rows)
    assert (ours_all[:, :hidden] - ref.pooler_output).abs().max().item() <= 1e-5
    for i, feature in enumerate(ref.deepstack_features):  # the order the blocks produce them (0, then 2)
        assert feature.abs().max() > 0.1
        assert (ours_all[:, hidden * (i + 1):hidden * (i + 2)] - feature).abs().max().item() <= 1e-5


@torch.no_grad()
def test_interleaved_mrope_matches_transformers(pair) -> None:
    _, hf, ours = pair
    cfg = hf.config.text_config
    positions = torch.randint(0, 4000, (3, 37))
    cos, sin = ours.language_model.rotary(positions, torch.float32)
    ref_cos, ref_sin = hf.model.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[:, None])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
    # Not the sectioned layout: the axes would take contiguous bands.
    sectioned = MRotaryEmbedding(cfg.head_dim, {**cfg.rope_parameters, "mrope_interleaved": False})
    assert not torch.allclose(sectioned(positions, torch.float32)[0], cos)


@torch.no_grad()
def test_prompt_without_deepstack_columns_is_text_only(pair) -> None:
    """The decoder takes plain hidden-wide rows as text-only rows (what adding zeros gives) and refuses other
    widths."""
    _, _, ours = pair
    ids = torch.arange(10, 30)
    spec = ours.kv_cache_spec()
    wide = ours(ours.embed_tokens(ids), torch.arange(20), single_sequence_prefill_context(20, spec, torch.float32))
    plain = ours(ours.language_model.embed_tokens(ids), torch.arange(20),
                 single_sequence_prefill_context(20, spec, torch.float32))
    assert torch.equal(wide, plain)
    with pytest.raises(ValueError, match="DeepStack"):
        ours(torch.zeros(20, 100), torch.arange(20), single_sequence_prefill_context(20, spec, torch.float32))


def test_moe_variant_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="Qwen3VLForConditionalGeneration"):
        resolve_family(["Qwen3VLMoeForConditionalGeneration"])


@torch.no_grad()
def test_tied_checkpoint_matches_transformers(tmp_path) -> None:
    """Qwen3-VL-2B and -4B tie the embeddings: the head reads the embedding matrix, DeepStack as in the 8B."""
    path = build_qwen3_vl(tmp_path, seed=9, tie_word_embeddings=True)
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ours = Qwen3VLForConditionalGeneration(hf.config)
    check_all_loaded(ours, ours.load_weights(iterate_checkpoint(path)))
    assert ours.lm_head is None
    items = _items(seed=3)[:1]
    ids = [20, 21, hf.config.vision_start_token_id] + [hf.config.image_token_id] * items[0].num_tokens + [30, 31]
    items[0].offset = 3
    embeds = ours.embed_tokens(torch.tensor(ids))
    embeds[3:3 + items[0].num_tokens] = ours.encode_images(items)[0]
    positions, _ = ours.prompt_positions(ids, items)
    ctx = single_sequence_prefill_context(len(ids), ours.kv_cache_spec(), torch.float32)
    logits = ours.compute_logits(ours(embeds, positions, ctx))
    input_ids = torch.tensor([ids])
    ref = hf(input_ids=input_ids, pixel_values=items[0].pixel_values, image_grid_thw=torch.tensor([GRIDS[0]]),
             mm_token_type_ids=(input_ids == hf.config.image_token_id).int()).logits[0]
    assert (logits - ref).abs().max().item() <= 1e-4
