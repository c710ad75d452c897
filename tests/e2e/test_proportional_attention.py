"""Proportional attention over pruned images (CPU, float32, greedy): the engine against transformers run on
hand-built inputs with log(tokens each kept token stands for) added to the attention logits on its key (a 4-D
additive mask), the counts written out here from the rule; nothing changes without pruning; chunked prefill
through a pruned image equals one chunk. On the Triton backend: tests/kernels/test_triton_backend_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm.pruning.base import TokenGrid
from flashvlm.pruning.pool import pool_indices
from flashvlm.pruning.registry import get_strategy
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl
from tests.e2e.test_pruning import _greedy, _hand_mrope, _image, _llm, _prompt, _run, _Transformers

GRID = TokenGrid(1, 8, 7)  # _image's 56 merged tokens on the tiny Qwen2-VL


@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen_proportional")
    build_qwen2_vl(path, seed=7)
    return str(path)


def _log_counts(feats: torch.Tensor, kept: np.ndarray) -> torch.Tensor:
    """log(1 + the dropped tokens whose most cosine-similar kept token is this one), per kept token."""
    x = feats / feats.norm(dim=-1, keepdim=True)
    sims = x @ x[torch.from_numpy(kept)].T
    counts = np.ones(len(kept))
    for i in range(feats.shape[0]):
        if i not in kept:
            counts[int(sims[i].argmax())] += 1
    assert counts.sum() == feats.shape[0]
    return torch.log(torch.from_numpy(counts).float())


@torch.inference_mode()
def _hf_generate(hf: _Transformers, embeds: torch.Tensor, positions: np.ndarray, delta: int, bias: torch.Tensor,
                 steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens with `bias` (one per prompt position) on the keys: full recompute each step, the causal
    mask plus the bias as transformers' 4-D additive attention mask."""
    embed = hf.model.get_input_embeddings()
    pos = torch.from_numpy(positions).view(3, 1, -1)
    tokens, first = [], None
    for _ in range(steps):
        n = embeds.shape[0]
        key_bias = torch.cat([bias, torch.zeros(n - bias.shape[0])])
        mask = torch.full((n, n), float("-inf")).triu(1) + key_bias[None, :]
        logits = hf.model(inputs_embeds=embeds[None], position_ids=pos, attention_mask=mask[None, None]).logits[0, -1]
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        nxt = torch.tensor([n + delta]).view(1, 1, 1).expand(3, 1, 1)
        pos = torch.cat([pos, nxt], dim=-1)
        embeds = torch.cat([embeds, embed(torch.tensor([tokens[-1]]))])
    return tokens, first


@pytest.mark.parametrize("strategy", ["pool", "divprune"])
@torch.inference_mode()
def test_proportional_attention_matches_transformers_with_the_bias_on_its_keys(tiny_qwen: str, strategy: str) -> None:
    import transformers

    llm = _llm(tiny_qwen, mm_token_pruning=strategy, mm_token_keep_ratio=0.25, mm_token_proportional_attention=True)
    prompt = _prompt(_image(1))
    processed = llm.engine.process_prompt(prompt)
    item = processed.mm_items[0]
    (out,), (ours_logits,) = _run(llm, [prompt])

    hf = _Transformers(transformers.Qwen2VLForConditionalGeneration, tiny_qwen)
    feats = hf.model.model.get_image_features(item.model_pixels(), torch.tensor([item.layout])).pooler_output[0]
    kept = (pool_indices(GRID, 14) if strategy == "pool" else get_strategy("divprune").select(feats, GRID, 0.25))
    kept = kept.numpy()
    assert item.num_tokens == len(kept) == 14
    ids = torch.tensor(processed.prompt_token_ids)
    embeds = hf.model.get_input_embeddings()(ids)
    embeds[item.offset:item.end] = feats[torch.from_numpy(kept)]
    bias = torch.zeros(len(ids))
    bias[item.offset:item.end] = _log_counts(feats, kept)
    assert bias.max() > 0  # the kept tokens stand for 56 in all
    positions, delta = _hand_mrope(len(ids), item.offset, item.end, (8, 7), kept)
    tokens, hf_logits = _hf_generate(hf, embeds, positions, delta, bias, 6)
    assert out.token_ids == tokens
    assert (ours_logits - hf_logits).abs().max().item() <= 1e-4
    # ...and the bias is what moved them: without it the first logits are transformers' unbiased ones.
    _, plain_logits = _hf_generate(hf, embeds, positions, delta, torch.zeros(len(ids)), 1)
    assert (ours_logits - plain_logits).abs().max().item() > 1e-3


def test_without_pruning_nothing_changes(tiny_qwen: str) -> None:
    plain, proportional = _llm(tiny_qwen), _llm(tiny_qwen, mm_token_proportional_attention=True)
    for prompt in (_prompt(_image(2)), _prompt(_image(3), text=" Which colour?")):  # one a batch: same rows
        (a,), (a_logits,) = _run(plain, [prompt])
        (b,), (b_logits,) = _run(proportional, [prompt])
        assert a.token_ids == b.token_ids
        assert torch.equal(a_logits, b_logits)


def test_chunked_prefill_through_a_pruned_image_equals_one_chunk(tiny_qwen: str) -> None:
    prompts = [_prompt(_image(4)), _prompt(_image(5), text=" And the shapes, how many?")]
    options = dict(mm_token_pruning="divprune", mm_token_keep_ratio=0.25, mm_token_proportional_attention=True)
    whole = _run(_llm(tiny_qwen, **options), prompts, _greedy(8))
    chunked = _run(_llm(tiny_qwen, max_num_batched_tokens=8, **options), prompts, _greedy(8))
    assert [o.token_ids for o in whole[0]] == [o.token_ids for o in chunked[0]]
    for a, b in zip(whole[1], chunked[1]):
        assert (a - b).abs().max().item() <= 1e-4

