"""Visual-token pruning in the engine on tiny checkpoints (CPU, float32, greedy): the engine's pruned prompt against
transformers run on inputs built by hand from its own vision embeddings (pool, divprune, dedup), the full
embeddings shared by two keep ratios of one image (but no KV), chunked prefill and preemption through pruned
images, Qwen3-VL's DeepStack features following the kept tokens, and bad settings. What only dedup does:
test_dedup_engine.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM, SamplingParams
from flashvlm.config import ConfigError
from flashvlm.processing.preprocess import token_blocks
from flashvlm.pruning.base import TokenGrid
from flashvlm.pruning.dedup import DedupStrategy
from flashvlm.pruning.pool import pool_indices
from flashvlm.pruning.registry import get_strategy
from flashvlm.request import InvalidRequestError
from flashvlm.testing.tiny_checkpoints import build_llava, build_llava_next, build_qwen2_vl, build_qwen3_vl

QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
LLAVA_IMAGE = "<image>\n"
BS = 8
PREFIX = "Look at this picture very carefully, please: "  # more than one small chunk of text before the image


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen_pruning")
    build_qwen2_vl(path, seed=7)
    return str(path)


@pytest.fixture(scope="module")
def qwen25(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen25_pruning")
    build_qwen2_vl(path, qwen25=True, seed=7)
    return str(path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3_pruning")
    build_qwen3_vl(path, seed=7)
    return str(path)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("llava_pruning")
    build_llava(path, seed=7)
    return str(path)


@pytest.fixture(scope="module")
def served(qwen: str) -> LLM:
    return _llm(qwen)


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("kv_cache_tokens", 2048)
    kw.setdefault("block_size", BS)
    return LLM(path, device="cpu", dtype="float32", **kw)


def _image(seed: int, w: int = 196, h: int = 224) -> np.ndarray:
    """196x224: a (1, 16, 14) patch grid, 8 x 7 = 56 merged tokens on Qwen."""
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _screenshot(seed: int, w: int = 196, h: int = 224) -> np.ndarray:
    """A flat margin around a 2 x 3 token window of noise (Qwen's 28 px tokens): 6 of the 56 tokens hold detail."""
    image = np.full((h, w, 3), 240, dtype=np.uint8)
    image[56:112, 28:112] = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    return image


def _dedup_kept(image: np.ndarray, ratio: float = 0.25, **params) -> np.ndarray:
    """What dedup keeps of a Qwen image that needs no resize, computed here from the pixels."""
    grid = TokenGrid(1, image.shape[0] // 28, image.shape[1] // 28)
    return DedupStrategy(**params).select_pixels(token_blocks(torch.from_numpy(image), 28), grid, ratio).numpy()


def _prompt(image: np.ndarray, text: str = " What is in it?", placeholder: str = QWEN_IMAGE, **pruning) -> dict:
    prompt = {"prompt": PREFIX + placeholder + text, "images": [image]}
    if pruning:
        prompt["mm_processor_kwargs"] = pruning
    return prompt


def _greedy(n: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _run(llm: LLM, prompts: list[dict], params: SamplingParams | None = None) -> tuple[list, list[torch.Tensor]]:
    """Outputs and the first-step logits of each."""
    llm.engine.runner.record_logits = True
    llm.engine.runner.recorded_logits.clear()
    outs = llm.generate(prompts, params or _greedy())
    return outs, [llm.engine.runner.recorded_logits[o.request_id][0] for o in outs]


def _hand_mrope(length: int, offset: int, end: int, grid_hw: tuple[int, int], kept: np.ndarray) -> tuple[np.ndarray,
                                                                                                          int]:
    """(3, length) M-RoPE positions of one image's kept tokens, written out from the rule (not our code): text
    counts up on all axes; the image's token at raster index k of an h x w grid sits at (base, base + k // w,
    base + k % w); the text after it resumes at base + max(h, w) as after the whole image."""
    h, w = grid_hw
    pos = np.zeros((3, length), dtype=np.int64)
    pos[:, :offset] = np.arange(offset)
    pos[0, offset:end] = offset
    pos[1, offset:end] = offset + kept // w
    pos[2, offset:end] = offset + kept % w
    resume = offset + max(h, w)
    pos[:, end:] = resume + np.arange(length - end)
    return pos, resume + length - end - length


class _Transformers:
    """The transformers model of a checkpoint, run on hand-built inputs_embeds and position_ids."""

    def __init__(self, cls: type, path: str) -> None:
        self.model = cls.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(self, embeds: torch.Tensor, positions: np.ndarray, delta: int, steps: int,
                 axes: int) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens (full recompute each step) and the first step's logits."""
        embed = self.model.get_input_embeddings()
        pos = torch.from_numpy(positions).view(axes, 1, -1) if axes == 3 else torch.from_numpy(positions)[None]
        tokens, first = [], None
        for _ in range(steps):
            logits = self.model(inputs_embeds=embeds[None], position_ids=pos).logits[0, -1]
            first = logits if first is None else first
            token = int(logits.argmax())
            tokens.append(token)
            nxt = torch.tensor([embeds.shape[0] + delta]).view(*([1] * (pos.dim() - 1)), 1)
            pos = torch.cat([pos, nxt.expand(*pos.shape[:-1], 1)], dim=-1)
            embeds = torch.cat([embeds, embed(torch.tensor([token]))])
        return tokens, first


@pytest.mark.parametrize(("variant", "strategy"), [("qwen2_vl", "pool"), ("qwen2_5_vl", "pool"),
                                                  ("qwen2_vl", "dedup"), ("qwen2_5_vl", "dedup")])
@torch.inference_mode()
def test_pool_and_dedup_match_transformers_on_hand_built_inputs(variant: str, strategy: str, request) -> None:
    import transformers

    qwen = request.getfixturevalue("qwen" if variant == "qwen2_vl" else "qwen25")
    cls = (transformers.Qwen2VLForConditionalGeneration if variant == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    llm = _llm(qwen, mm_token_pruning=strategy, mm_token_keep_ratio=0.5)
    image = _image(1) if strategy == "pool" else _screenshot(1)
    # dedup: the 6 window tokens (rows 2-3, columns 1-3) and the top-left token of each of the 2 x 2 tiles (4 x 4
    # tokens); every other margin token equals its left or upper neighbour in its tile (written out from the rule).
    kept = pool_indices(TokenGrid(1, 8, 7), 28).numpy() if strategy == "pool" else \
        np.array([0, 4, 15, 16, 17, 22, 23, 24, 28, 32])
    if strategy == "dedup":
        np.testing.assert_array_equal(_dedup_kept(image, 0.5), kept)
    prompt = _prompt(image)
    processed = llm.engine.process_prompt(prompt)
    item = processed.mm_items[0]
    assert item.pruning is not None and item.pruning.grid == TokenGrid(1, 8, 7)
    assert item.encoder_tokens == 56 and item.num_tokens == len(kept) and item.end - item.offset == len(kept)
    (out,), (ours_logits,) = _run(llm, [prompt])
    assert out.num_image_tokens == 56 and out.num_image_tokens_kept == len(kept)

    hf = _Transformers(cls, qwen)
    feats = hf.model.model.get_image_features(item.model_pixels(), torch.tensor([item.layout])).pooler_output[0]
    ids = torch.tensor(processed.prompt_token_ids)
    embeds = hf.model.get_input_embeddings()(ids)
    embeds[item.offset:item.end] = feats[torch.from_numpy(kept)]
    positions, delta = _hand_mrope(len(ids), item.offset, item.end, (8, 7), kept)
    tokens, hf_logits = hf.generate(embeds, positions, delta, 6, axes=3)
    assert out.token_ids == tokens
    assert (ours_logits - hf_logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("strategy", ["pool", "divprune"])
@torch.inference_mode()
def test_deepstack_follows_the_kept_tokens(qwen3: str, strategy: str) -> None:
    """Qwen3-VL: the kept indices (chosen from the image embeddings alone) select each DeepStack feature too, and
    the features go to the kept tokens' rows, as transformers' language model adds them when handed the kept
    embeddings, features and positions by hand (full recompute each step)."""
    import transformers

    llm = _llm(qwen3, mm_token_pruning=strategy, mm_token_keep_ratio=0.4)
    prompt = _prompt(_image(2))
    processed = llm.engine.process_prompt(prompt)
    item = processed.mm_items[0]
    grid = TokenGrid(1, 7, 6)  # 196x224 at 32 pixels a merged token
    assert item.pruning is not None and item.pruning.grid == grid and item.num_tokens == 17
    (out,), (ours_logits,) = _run(llm, [prompt])

    model = transformers.Qwen3VLForConditionalGeneration.from_pretrained(qwen3, dtype=torch.float32).eval()
    vision = model.model.visual(item.model_pixels(), grid_thw=torch.tensor([item.layout]))
    kept = get_strategy(strategy).select(vision.pooler_output, grid, 0.4)
    ids = torch.tensor(processed.prompt_token_ids)
    embeds = model.get_input_embeddings()(ids)
    embeds[item.offset:item.end] = vision.pooler_output[kept]
    stack = [feature[kept] for feature in vision.deepstack_features]
    mask = torch.zeros(1, len(ids), dtype=torch.bool)
    mask[0, item.offset:item.end] = True
    positions, delta = _hand_mrope(len(ids), item.offset, item.end, (7, 6), kept.numpy())
    pos = torch.from_numpy(positions).view(3, 1, -1)
    tokens, first = [], None
    for _ in range(6):
        hidden = model.model.language_model(inputs_embeds=embeds[None], position_ids=pos, visual_pos_masks=mask,
                                            deepstack_visual_embeds=stack).last_hidden_state
        logits = model.lm_head(hidden)[0, -1]
        first = logits if first is None else first
        tokens.append(int(logits.argmax()))
        pos = torch.cat([pos, torch.full((3, 1, 1), embeds.shape[0] + delta)], dim=-1)
        embeds = torch.cat([embeds, model.get_input_embeddings()(torch.tensor(tokens[-1:]))])
        mask = torch.cat([mask, torch.zeros(1, 1, dtype=torch.bool)], dim=1)
    assert out.token_ids == tokens
    assert (ours_logits - first).abs().max().item() <= 1e-4


@torch.inference_mode()
def test_hand_built_positions_are_transformers_own_when_nothing_is_pruned(qwen: str) -> None:
    """The reference above is only as good as `_hand_mrope`: unpruned, it must give what transformers computes
    from the image grid itself."""
    from transformers import Qwen2VLForConditionalGeneration

    llm = _llm(qwen)
    processed = llm.engine.process_prompt(_prompt(_image(1)))
    item = processed.mm_items[0]
    assert item.pruning is None and item.num_tokens == 56
    hf = _Transformers(Qwen2VLForConditionalGeneration, qwen)
    ids = torch.tensor([processed.prompt_token_ids])
    own = hf.model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=item.model_pixels(),
                   image_grid_thw=torch.tensor([item.layout]),
                   mm_token_type_ids=(ids == llm.engine.model.image_token_id).long()).logits[0, -1]
    feats = hf.model.model.get_image_features(item.model_pixels(), torch.tensor([item.layout])).pooler_output[0]
    embeds = hf.model.get_input_embeddings()(ids[0])
    embeds[item.offset:item.end] = feats
    positions, delta = _hand_mrope(ids.shape[1], item.offset, item.end, (8, 7), np.arange(56))
    _, hand = hf.generate(embeds, positions, delta, 1, axes=3)
    assert (own - hand).abs().max().item() <= 1e-5


@pytest.mark.parametrize("strategy", ["divprune", "dedup"])
@torch.inference_mode()
def test_llava_divprune_and_dedup_match_transformers_on_hand_built_inputs(llava: str, strategy: str) -> None:
    """LLaVA's plain RoPE: kept tokens keep their own positions (offset + index), the text after the image sits
    where it would after all of it. dedup reads CLIP's normalized floats back to levels."""
    from transformers import LlavaForConditionalGeneration

    from flashvlm.pruning.divprune import DivPruneStrategy

    llm = _llm(llava)
    image, ratio = _image(2), 0.5
    if strategy == "dedup":
        image[:, 98:], ratio = 30, 1.0  # the right half flat: about half of the tokens, uncapped
    prompt = _prompt(image, placeholder=LLAVA_IMAGE, mm_token_pruning=strategy, mm_token_keep_ratio=ratio)
    processed = llm.engine.process_prompt(prompt)
    item = processed.mm_items[0]
    grid = item.pruning.grid
    assert grid.t == 1 and grid.num_tokens == item.encoder_tokens
    if strategy == "divprune":
        assert item.num_tokens == -(-grid.num_tokens // 2)
    else:
        assert grid.num_tokens // 2 <= item.num_tokens < grid.num_tokens
    (out,), (ours_logits,) = _run(llm, [prompt])

    hf = _Transformers(LlavaForConditionalGeneration, llava)
    feats = hf.model.model.get_image_features(item.pixel_values[None]).pooler_output[0]
    if strategy == "divprune":
        kept = DivPruneStrategy().select(feats, grid, 0.5)
    else:
        inputs = llm.engine.input_processor.image_inputs
        kept = DedupStrategy().select_pixels(inputs.token_pixels(item), grid, ratio)
    ids = torch.tensor(processed.prompt_token_ids)
    embeds = hf.model.get_input_embeddings()(ids)
    embeds[item.offset:item.end] = feats[kept]
    dropped = grid.num_tokens - item.num_tokens
    positions = np.arange(len(ids), dtype=np.int64)
    positions[item.offset:item.end] = item.offset + kept.numpy()
    positions[item.end:] += dropped
    tokens, hf_logits = hf.generate(embeds, positions, dropped, 6, axes=1)
    assert out.token_ids == tokens
    assert (ours_logits - hf_logits).abs().max().item() <= 1e-4


def test_memory_profile_counts_the_images_a_pruned_step_holds(llava: str) -> None:
    full = _llm(llava).engine.input_processor.profile_items(budget_tokens=100)
    pruned = _llm(llava, mm_token_pruning="pool", mm_token_keep_ratio=0.25).engine.input_processor
    assert len(full) == 100 // 16 and len(pruned.profile_items(budget_tokens=100)) == 100 // 4
    assert all(item.pruning is None and item.num_tokens == 16 for item in full)
    # dedup may keep as few as one token a 4 x 4 tile: the tiny LLaVA's 4 x 4 grid is one tile.
    dedup = _llm(llava, mm_token_pruning="dedup", mm_token_keep_ratio=0.5).engine.input_processor
    assert len(dedup.profile_items(budget_tokens=100)) == 100


def test_image_tokens_that_form_no_grid_are_not_pruned(llava: str) -> None:
    """LLaVA keeping the CLS token (vision_feature_select_strategy 'full'): a pruned request is refused, an engine
    pruning by default does not start, unpruned requests run."""
    full_cls = {"vision_feature_select_strategy": "full"}
    with pytest.raises(ConfigError, match="form no grid"):
        _llm(llava, hf_overrides=full_cls, mm_token_pruning="pool")
    llm = _llm(llava, hf_overrides=full_cls)
    with pytest.raises(InvalidRequestError, match="form no grid"):
        llm.generate([_prompt(_image(8), placeholder=LLAVA_IMAGE, mm_token_pruning="pool")], _greedy(2))
    out = llm.generate([_prompt(_image(8), placeholder=LLAVA_IMAGE)], _greedy(2))[0]
    assert out.num_image_tokens == out.num_image_tokens_kept == 17


def test_llava_next_tiles_are_not_pruned(tmp_path) -> None:
    """LLaVA-NeXT's tokens (base image, then unpadded tiles with a newline per row) form no grid: pruning is refused
    by name, for the engine and for a request, and unpruned requests run."""
    path = str(build_llava_next(tmp_path, seed=7))
    with pytest.raises(ConfigError, match="LLaVA-NeXT"):
        _llm(path, mm_token_pruning="divprune", mm_token_keep_ratio=0.5)
    llm = _llm(path)
    with pytest.raises(InvalidRequestError, match="form no grid.*LLaVA-NeXT"):
        llm.generate([_prompt(_image(8), placeholder=LLAVA_IMAGE, mm_token_pruning="pool")], _greedy(2))
    out = llm.generate([_prompt(_image(8), placeholder=LLAVA_IMAGE)], _greedy(2))[0]
    assert len(out.token_ids) == 2 and out.num_image_tokens == out.num_image_tokens_kept > 16


def _count_encoder_calls(llm: LLM) -> list[int]:
    calls: list[int] = []
    model = llm.engine.model
    original = model.encode_images

    def counted(items):
        calls.append(len(items))
        return original(items)

    model.encode_images = counted
    return calls


def test_two_keep_ratios_share_the_vision_work_but_no_kv(qwen: str) -> None:
    image = _image(3)
    half, quarter = _prompt(image, mm_token_pruning="pool", mm_token_keep_ratio=0.5), \
        _prompt(image, mm_token_pruning="divprune", mm_token_keep_ratio=0.25)
    alone = [_run(_llm(qwen, enable_prefix_caching=False, encoder_cache_tokens=0), [p]) for p in (half, quarter)]
    llm = _llm(qwen)
    calls = _count_encoder_calls(llm)
    outs, logits = _run(llm, [half, quarter])
    assert calls == [1], "one image in two settings runs the vision tower once"
    assert llm.engine.runner.kept_tokens.num_selections == 2
    for (want_outs, want_logits), got, got_logits in zip(alone, outs, logits):
        assert got.token_ids == want_outs[0].token_ids
        assert (got_logits - want_logits[0]).abs().max().item() <= 1e-5  # a batch of two: other GEMM shapes
    # Sequentially: the other setting shares only the text blocks before the image, the same setting all of it.
    offset = llm.engine.process_prompt(half).mm_items[0].offset
    again_other, _ = _run(llm, [_prompt(image, mm_token_pruning="pool", mm_token_keep_ratio=0.25)])
    assert 0 < again_other[0].num_cached_tokens <= offset
    again_same, _ = _run(llm, [half])
    assert again_same[0].num_cached_tokens > offset and again_same[0].token_ids == outs[0].token_ids
    unpruned, _ = _run(llm, [_prompt(image)])
    assert unpruned[0].num_cached_tokens <= offset
    assert calls == [1] and llm.engine.stats()["images_encoded"] == 1
    stats = llm.engine.stats()
    assert stats["image_tokens"] == 5 * 56 and stats["image_tokens_kept"] == 28 + 14 + 14 + 28 + 56


@pytest.mark.parametrize(("variant", "kept"), [("qwen", [2 * 17, 28, 56, 10]), ("qwen3", [2 * 13, 21, 42, 11])])
def test_chunked_prefill_through_pruned_images_equals_unchunked(variant: str, kept: list[int], request) -> None:
    """Qwen3-VL: a chunk starting inside a pruned image takes its share of the kept rows, DeepStack included."""
    qwen = request.getfixturevalue(variant)
    prompts = [
        {"prompt": PREFIX + QWEN_IMAGE + " and " + QWEN_IMAGE + " compare them.", "images": [_image(4), _image(5)],
         "mm_processor_kwargs": {"mm_token_pruning": "divprune", "mm_token_keep_ratio": 0.3}},
        _prompt(_image(4), mm_token_pruning="pool", mm_token_keep_ratio=0.5),
        _prompt(_image(6), " short."),
        _prompt(_screenshot(7), " and this one?", mm_token_pruning="dedup", mm_token_dedup_threshold=0),
    ]
    whole, whole_logits = _run(_llm(qwen, max_num_batched_tokens=512), prompts)
    chunked_llm = _llm(qwen, max_num_batched_tokens=5)
    chunked, chunked_logits = _run(chunked_llm, prompts)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]
    for a, b in zip(chunked_logits, whole_logits):
        assert (a - b).abs().max().item() <= 1e-4
    assert [o.num_image_tokens_kept for o in whole] == kept


def test_preemption_and_recompute_keep_pruned_outputs(qwen: str) -> None:
    prompts = [_prompt((_image, _image, _screenshot)[i % 3](10 + i), f" Question {i}?",
                       mm_token_pruning=("pool", "divprune", "dedup")[i % 3], mm_token_keep_ratio=0.25)
               for i in range(6)]
    roomy, roomy_logits = _run(_llm(qwen), prompts, _greedy(24))
    # 12 blocks of 8 tokens: one request fits (about 40 prompt tokens + 24), three growing together do not. No
    # encoder cache: a preempted request's image is encoded again, its tokens chosen again and placed again.
    tight_llm = _llm(qwen, kv_cache_tokens=96, max_num_batched_tokens=64, encoder_cache_tokens=0)
    tight, tight_logits = _run(tight_llm, prompts, _greedy(24))
    assert tight_llm.engine.scheduler.num_preemptions_total > 0
    assert tight_llm.engine.runner.kept_tokens.num_selections > len(prompts)
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    for a, b in zip(tight_logits, roomy_logits):
        assert (a - b).abs().max().item() <= 1e-4
    bm = tight_llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_pruned_prompts_run_the_same_with_graphs_and_eager(qwen: str) -> None:
    prompts = [_prompt(_screenshot(50), mm_token_pruning="dedup"), _prompt(_image(51), mm_token_pruning="pool"),
               _prompt(_image(52), mm_token_pruning="divprune", mm_token_keep_ratio=0.5), _prompt(_image(53))]
    common = dict(device="cuda", dtype="bfloat16", kv_cache_tokens=4096, block_size=16, max_num_batched_tokens=256,
                  prefill_graph_max_tokens=256)
    answers = {}
    for name, kw in {"graphs": {}, "eager": dict(enforce_eager=True)}.items():
        llm = LLM(qwen, **common, **kw)
        answers[name] = [o.token_ids for o in llm.generate(prompts, _greedy(16))]
        if name == "graphs":
            assert llm.engine.runner.graphs is not None
    assert answers["graphs"] == answers["eager"]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"mm_token_keep_ratio": 0}, "(0, 1]"),
    ({"mm_token_keep_ratio": 1.5}, "(0, 1]"),
    ({"mm_token_keep_ratio": "abc"}, "must be a number"),
    ({"mm_token_keep_ratio": True}, "must be a number"),
    ({"mm_token_pruning": "fastv"}, "unknown visual-token pruning strategy"),
    ({"mm_token_pruning": ["pool"]}, "unknown visual-token pruning strategy"),
    ({"mm_token_pruning": "dedup", "mm_token_dedup_threshold": 300}, "mm_token_dedup_threshold must be in [0, 255]"),
    ({"mm_token_pruning": "dedup", "mm_token_dedup_threshold": "abc"}, "mm_token_dedup_threshold must be a number"),
    ({"mm_token_pruning": "dedup", "mm_token_keep_ratio": 0}, "(0, 1]"),
])
def test_bad_pruning_settings_are_clear_errors_and_the_engine_serves_on(served: LLM, kwargs: dict,
                                                                       needle: str) -> None:
    llm = served
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([_prompt(_image(20), **kwargs)], _greedy(2))
    assert needle in str(err.value)
    with pytest.raises(InvalidRequestError):
        llm.chat([{"role": "user", "content": "hi"}], _greedy(2), mm_processor_kwargs=kwargs)
    out = llm.generate([_prompt(_image(20), mm_token_pruning="pool")], _greedy(2))[0]
    assert len(out.token_ids) == 2 and out.num_image_tokens_kept == 14
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(("option", "value", "needle"), [
    ("mm_token_pruning", "fastv", "unknown visual-token pruning strategy"),
    ("mm_token_dedup_threshold", -1, "mm_token_dedup_threshold must be in [0, 255]"),
    ("mm_token_keep_ratio", 0.0, "mm_token_keep_ratio must be in (0, 1]"),
    ("mm_token_keep_ratio", "abc", "mm_token_keep_ratio must be a number"),
])
def test_bad_engine_pruning_options_refused_before_loading(option: str, value, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        LLM("/nonexistent/checkpoint", device="cpu", **{option: value})
    assert needle in str(err.value)
