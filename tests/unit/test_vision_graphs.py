"""Vision-tower graph bookkeeping (capture on the second sight of a shape, replay with new pixels, LRU), on CPU
with an eager stand-in for the CUDA graph: replay re-runs the captured function on the captured input buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm import LLM
from flashvlm.runner.vision_graphs import VisionGraphs
from flashvlm.testing.tiny_checkpoints import build_qwen2_vl


class EagerGraph:
    def capture(self, fn, pool):
        self.fn = fn
        self.outputs = [o.clone() for o in fn()]  # the graph's own output buffers
        return self.outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.fn()):
            out.copy_(new)


@torch.inference_mode()  # as the runner calls the tower; cached index tensors are inference tensors
def test_capture_on_second_sight_replay_with_new_pixels_and_lru(tmp_path) -> None:
    llm = LLM(str(build_qwen2_vl(tmp_path / "m", seed=2)), device="cpu", kv_cache_tokens=4096, dtype="float32")
    engine, model = llm.engine, llm.engine.runner.model
    graphs = VisionGraphs(model.encode_images, torch.device("cpu"), torch.float32, max_graphs=2,
                          graph_factory=EagerGraph)
    rng = np.random.default_rng(0)

    def items(h: int, w: int):
        img = rng.integers(0, 256, (h, w, 3), np.uint8)
        return engine.process_prompt({"prompt": "<|vision_start|><|image_pad|><|vision_end|>x",
                                      "images": [img]}).mm_items

    def check(batch) -> None:
        got = graphs(batch)
        want = model.encode_images(batch)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)

    check(items(56, 84))                  # first sight: eager
    assert graphs.num_captures == 0
    check(items(56, 84))                  # second sight: captured (and run)
    assert (graphs.num_captures, graphs.num_replays) == (1, 1)
    first = graphs(items(56, 84))         # replay with other pixels: outputs follow the new input
    check(items(56, 84))
    assert graphs.num_replays == 3
    again = graphs(items(56, 84))
    assert not torch.equal(first[0], again[0])  # returned copies, not the graph's own (overwritten) buffers
    for size in ((84, 84), (84, 84), (112, 56), (112, 56)):  # two more shapes captured: the oldest is evicted
        check(items(*size))
    assert graphs.num_captures == 3 and len(graphs._graphs) == 2
    assert VisionGraphs.key(items(56, 84)) not in graphs._graphs
    check(items(56, 84) + items(84, 84))  # a batch of two images is its own shape
    assert graphs.num_captures == 3


def test_runner_uses_vision_graphs_when_set(tmp_path) -> None:
    """The engine path: outputs with the (stand-in) graphs equal the eager tower's."""
    from flashvlm import SamplingParams

    path = str(build_qwen2_vl(tmp_path / "m", seed=4))
    rng = np.random.default_rng(1)
    prompts = [{"prompt": "<|vision_start|><|image_pad|><|vision_end|>Describe.",
                "images": [rng.integers(0, 256, (56, 56, 3), np.uint8)]} for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    opts = dict(device="cpu", kv_cache_tokens=4096, dtype="float32", enable_prefix_caching=False,
                encoder_cache_tokens=0)
    expected = [o.token_ids for o in LLM(path, **opts).generate(prompts, params)]
    llm = LLM(path, **opts)
    runner = llm.engine.runner
    runner.vision_graphs = VisionGraphs(runner.model.encode_images, torch.device("cpu"), torch.float32,
                                        graph_factory=EagerGraph)
    # One prompt at a time: each step then encodes one image of the same shape, which recurs.
    assert [llm.generate(p, params)[0].token_ids for p in prompts] == expected
    assert runner.vision_graphs.num_replays >= 1


@torch.inference_mode()
def test_graph_keeps_its_index_tensors_and_failed_captures_stay_eager(tmp_path) -> None:
    llm = LLM(str(build_qwen2_vl(tmp_path / "m", seed=2)), device="cpu", kv_cache_tokens=4096, dtype="float32")
    engine, model = llm.engine, llm.engine.runner.model
    rng = np.random.default_rng(3)

    def two_images():
        imgs = [rng.integers(0, 256, (56, 84, 3), np.uint8) for _ in range(2)]
        prompt = "<|vision_start|><|image_pad|><|vision_end|>" * 2 + "x"
        return engine.process_prompt({"prompt": prompt, "images": imgs}).mm_items

    graphs = VisionGraphs(model.encode_images, torch.device("cpu"), torch.float32, graph_factory=EagerGraph)
    graphs(two_images())
    graphs(two_images())  # captured: two equal segments go through the gather/scatter index tensors
    (entry,) = graphs._graphs.values()
    assert entry.keepalive, "the graph must own the index tensors it reads by address"

    class FailingGraph(EagerGraph):
        def capture(self, fn, pool):
            raise RuntimeError("operation not permitted when stream is capturing")

    failing = VisionGraphs(model.encode_images, torch.device("cpu"), torch.float32, graph_factory=FailingGraph)
    for _ in range(3):
        batch = two_images()
        for got, want in zip(failing(batch), model.encode_images(batch)):
            torch.testing.assert_close(got, want)
    assert failing.num_captures == 0 and len(failing._failed) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_cuda_graph_captured_without_warm_up_runs_equals_the_eager_tower(tmp_path) -> None:
    """The real CUDA graph, captured with no warm-up runs on a shape's second sight (its first ran eagerly), one
    and two images a batch: every replay equals the eager tower on new pixels and no capture failed."""
    llm = LLM(str(build_qwen2_vl(tmp_path / "m", seed=5)), device="cuda", kv_cache_tokens=4096, dtype="bfloat16",
              enforce_eager=True)
    engine, model = llm.engine, llm.engine.runner.model
    graphs = VisionGraphs(model.encode_images, torch.device("cuda"), torch.bfloat16)
    rng = np.random.default_rng(6)

    def batch(n: int):
        imgs = [rng.integers(0, 256, (84, 112, 3), np.uint8) for _ in range(n)]
        prompt = "<|vision_start|><|image_pad|><|vision_end|>" * n + "x"
        return engine.process_prompt({"prompt": prompt, "images": imgs}).mm_items  # compact uint8 pixels

    for n in (1, 2):
        for _ in range(4):  # eager; captured and replayed; replayed twice
            items = batch(n)
            for got, want in zip(graphs(items), model.encode_images(items)):
                torch.testing.assert_close(got, want)
    assert (graphs.num_captures, graphs.num_replays, len(graphs._failed)) == (2, 6, 0)
