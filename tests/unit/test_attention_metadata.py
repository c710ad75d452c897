"""Each backend's metadata, built from a backend-neutral AttentionStep, and its CUDA-graph buffers equal what the
runner used to build by hand (eager steps, decode graphs, padded step-graph buckets), on random layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashvlm.attention import ATTENTION_BACKENDS, AttentionMetadata, AttentionStep, get_backend
from flashvlm.attention.base import GraphAttentionBuffers
from flashvlm.attention.reference import ReferenceBackend
from flashvlm.attention.vision import VISION_BACKENDS, set_vision_attention, vision_backend

BLOCK = 4
FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping")


def _graph_backends() -> list[str]:
    from flashvlm.attention import triton_backend

    return [] if triton_backend._IMPORT_ERROR is not None else ["triton", "fa4"]


def _layout(rng: np.random.Generator) -> tuple[list[int], list[int], np.ndarray]:
    """Random query lengths (decode rows among them), cached context lengths and block tables."""
    b = int(rng.integers(1, 7))
    q_lens = [int(rng.choice([1, rng.integers(1, 20)])) for _ in range(b)]
    ctx = [int(rng.integers(0, 30)) for _ in range(b)]
    width = max((c + q + BLOCK - 1) // BLOCK for c, q in zip(ctx, q_lens))
    tables = np.zeros((b, width), dtype=np.int32)
    perm = rng.permutation(np.arange(1, 1 + b * width))
    for i, (c, q) in enumerate(zip(ctx, q_lens)):
        n = (c + q + BLOCK - 1) // BLOCK
        tables[i, :n] = perm[i * width: i * width + n]
    return q_lens, ctx, tables


def _old_metadata(q_lens: list[int], ctx: list[int], tables: np.ndarray) -> AttentionMetadata:
    """What runner/inputs.py built by hand for an eager step."""
    seq_lens = [c + q for c, q in zip(ctx, q_lens)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).tolist()
    slots = [int(tables[i, t // BLOCK]) * BLOCK + t % BLOCK for i in range(len(q_lens)) for t in range(ctx[i],
                                                                                                      seq_lens[i])]
    return AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.from_numpy(tables.copy()), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=BLOCK, query_start_loc_host=qsl, seq_lens_host=seq_lens, max_query_len=max(q_lens),
        max_seq_len=max(seq_lens))


def _step(meta: AttentionMetadata) -> AttentionStep:
    return AttentionStep(query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                         block_tables=meta.block_tables, slot_mapping=meta.slot_mapping, block_size=meta.block_size,
                         query_start_loc_host=meta.query_start_loc_host, seq_lens_host=meta.seq_lens_host,
                         max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len)


def _assert_same_tensors(a: AttentionMetadata, b: AttentionMetadata) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.block_size, a.max_query_len, a.max_seq_len, a.num_seqs, a.is_pure_decode) == (
        b.block_size, b.max_query_len, b.max_seq_len, b.num_seqs, b.is_pure_decode)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", ["reference", *_graph_backends()])
def test_eager_metadata_from_a_step_equals_the_old_builder(name: str, seed: int) -> None:
    old = _old_metadata(*_layout(np.random.default_rng(seed)))
    meta = get_backend(name).build_metadata(_step(old))
    _assert_same_tensors(meta, old)
    if name == "reference":  # the host loop reads the host copies
        assert (meta.query_start_loc_host, meta.seq_lens_host) == (old.query_start_loc_host, old.seq_lens_host)
    else:  # the graph-capturable backends never read them
        assert meta.query_start_loc_host is None and meta.seq_lens_host is None


def _expected_buffers(prev: dict[str, torch.Tensor], old: AttentionMetadata, tokens: int,
                      seqs: int) -> dict[str, torch.Tensor]:
    """What StepGraphs.run() left in its buffers after a step, written out as whole padded prefixes: the step's
    values, then padding up to the bucket (slot -1; no new tokens, length 0); the rest as it was."""
    slots, qsl, lens = old.slot_mapping.tolist(), old.query_start_loc_host, old.seq_lens_host
    want = {name: t.clone() for name, t in prev.items()}
    want["slot_mapping"][:tokens] = torch.tensor(slots + [-1] * (tokens - len(slots)))
    want["query_start_loc"][: seqs + 1] = torch.tensor(qsl + [qsl[-1]] * (seqs - len(lens)))
    want["seq_lens"][:seqs] = torch.tensor(lens + [0] * (seqs - len(lens)))
    rows, width = old.block_tables.shape
    want["block_tables"][:rows, :width] = old.block_tables  # stale entries beyond: never read
    return want


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("name", _graph_backends())
def test_step_graph_hooks_equal_the_old_padding(name: str, seed: int) -> None:
    """Several steps through one set of buffers (buckets larger than each step, the previous step's values left in
    place): they hold exactly what StepGraphs wrote, and the captured metadata views them with the bucket's
    bounds."""
    rng = np.random.default_rng(100 + seed)
    backend = get_backend(name)
    t_max, s_max, max_blocks, max_model_len = 128, 8, 16, 64
    new = backend.graph_buffers(t_max, s_max, max_blocks, BLOCK, torch.device("cpu"))
    # As StepGraphs allocated them: every row padding.
    assert (new.slot_mapping == -1).all() and new.slot_mapping.dtype == torch.long
    shapes = {"query_start_loc": (s_max + 1,), "seq_lens": (s_max,), "block_tables": (s_max, max_blocks)}
    for field, shape in shapes.items():
        t = getattr(new, field)
        assert t.shape == shape and t.dtype == torch.int32 and not t.any(), field
    state = {name: getattr(new, name).clone() for name in FIELDS}
    for _ in range(4):
        old = _old_metadata(*_layout(rng))
        n, b = old.slot_mapping.shape[0], old.num_seqs
        tokens, seqs = int(rng.integers(n, t_max + 1)), int(rng.integers(b, s_max + 1))
        backend.fill_graph_buffers(new, _step(old), tokens, seqs)
        state = _expected_buffers(state, old, tokens, seqs)
        for field in FIELDS:
            assert torch.equal(getattr(new, field), state[field]), field
        meta = backend.graph_metadata(new, tokens, seqs, max_query_len=tokens, max_seq_len=max_model_len)
        assert meta.slot_mapping.data_ptr() == new.slot_mapping.data_ptr()  # views: what the graph reads
        assert (meta.num_seqs, meta.slot_mapping.shape[0], meta.max_query_len, meta.max_seq_len, meta.block_size) == (
            seqs, tokens, tokens, max_model_len, BLOCK)
        assert meta.query_start_loc_host is None and meta.seq_lens_host is None


@pytest.mark.parametrize("name", _graph_backends())
def test_decode_graph_metadata_equals_the_old_views(name: str) -> None:
    """DecodeGraphs' packed buffers wrapped as the backend's graph buffers give the views its own _meta gave."""
    n, max_blocks = 8, 5
    i32 = torch.arange(n + n * max_blocks, dtype=torch.int32)
    buf = GraphAttentionBuffers(torch.arange(n + 1, dtype=torch.int32), i32[:n], i32[n:].view(n, max_blocks),
                                torch.arange(n, dtype=torch.long), BLOCK)
    backend = get_backend(name)
    for size in (1, 2, 4, 8):
        meta = backend.graph_metadata(buf, size, size, max_query_len=1, max_seq_len=96)
        assert torch.equal(meta.query_start_loc, buf.query_start_loc[: size + 1])
        assert torch.equal(meta.seq_lens, buf.seq_lens[:size])
        assert torch.equal(meta.slot_mapping, buf.slot_mapping[:size])
        assert torch.equal(meta.block_tables, buf.block_tables[:size])
        assert meta.is_pure_decode and meta.max_seq_len == 96 and meta.num_seqs == size
    backend.reset_graph_buffers(buf)
    assert (buf.slot_mapping == -1).all() and (buf.seq_lens == 0).all()
    assert torch.equal(buf.query_start_loc, torch.arange(n + 1, dtype=torch.int32))  # decode keeps its offsets


def test_the_reference_backend_refuses_graph_capture() -> None:
    buf = ReferenceBackend().graph_buffers(16, 2, 4, BLOCK, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="cannot be captured"):
        ReferenceBackend().graph_metadata(buf, 16, 2, 16, 64)


def test_backends_are_looked_up_by_name() -> None:
    assert set(ATTENTION_BACKENDS) == {"reference", "triton", "fa4"}
    assert get_backend("reference").name == "reference"
    with pytest.raises(ValueError, match="available: reference, triton, fa4"):
        get_backend("flash")
    assert {name: vision_backend(name).name for name in VISION_BACKENDS} == {"sdpa": "sdpa", "fa4": "fa4"}
    with pytest.raises(ValueError, match="unknown vision attention backend"):
        vision_backend("triton")
    with pytest.raises(ValueError, match="unknown vision attention backend"):
        set_vision_attention(torch.nn.Linear(2, 2), "flash")
