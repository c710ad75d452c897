"""Greedy max-min diverse selection (divprune's loop) in one launch.

Given an (N, N) distance matrix whose diagonal is -1 and a seed row, pick `count` rows: the seed, then each time
the row whose distance to its nearest picked row is largest (the first such row on ties). The torch loop
(`max_min_select_reference`) runs three small kernels a pick (a row read, a minimum, an argmax): about 1,700
launches for 576 picks of 2,304 tokens, so its time is the host's. Here one program keeps the running minimum
distances in registers (or, past `BLOCK` rows, in a scratch vector it alone reads and writes) and loops over the
picks, reading one matrix row each. Every value it compares is a float32 element of the matrix or a minimum of
them, so it picks exactly what the reference picks.
Reference: `max_min_select_reference` (kernels/max_min_torch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 8192
"""Rows kept in registers by one program (16 a thread at 16 warps); longer matrices go through scratch."""


@triton.jit
def _first_argmax(values, offs, n_pad):
    m = tl.max(values, axis=0)
    return tl.min(tl.where(values == m, offs, n_pad), axis=0), m


@triton.jit
def _max_min_select_kernel(dist_ptr, seed_ptr, out_ptr, scratch_ptr, n, count,
                           BLOCK: tl.constexpr, IN_REGISTERS: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    pick = tl.load(seed_ptr).to(tl.int64)
    if IN_REGISTERS:
        inside = lanes < n
        # Lanes past the matrix start at -inf, below any distance, so they are never picked.
        to_kept = tl.where(inside, float("inf"), float("-inf"))
        for step in range(count):
            tl.store(out_ptr + step, pick)
            row = tl.load(dist_ptr + pick * n + lanes, mask=inside, other=float("-inf"))
            to_kept = tl.minimum(to_kept, row)
            pick, _ = _first_argmax(to_kept, lanes, BLOCK)
            pick = pick.to(tl.int64)
    else:
        for start in range(0, n, BLOCK):
            offs = start + lanes
            tl.store(scratch_ptr + offs, tl.full([BLOCK], float("inf"), tl.float32), mask=offs < n)
        # Every lane's inf is stored before any lane reads the scratch back (a lane may read another's element).
        tl.debug_barrier()
        for step in range(count):
            tl.store(out_ptr + step, pick)
            best = tl.full([], float("-inf"), tl.float32)
            best_i = pick * 0
            for start in range(0, n, BLOCK):
                offs = start + lanes
                inside = offs < n
                # A lane may read an element another lane already lowered in this pick: min is idempotent, so
                # either value gives the same result; earlier picks' stores are ordered by the reductions' barriers.
                kept = tl.load(scratch_ptr + offs, mask=inside, other=float("-inf"))
                row = tl.load(dist_ptr + pick * n + offs, mask=inside, other=float("-inf"))
                kept = tl.minimum(kept, row)
                tl.store(scratch_ptr + offs, kept, mask=inside)
                chunk_i, chunk_max = _first_argmax(tl.where(inside, kept, float("-inf")), offs, n + BLOCK)
                # Strictly larger: an equal maximum in a later chunk has a larger index.
                take = chunk_max > best
                best_i = tl.where(take, chunk_i.to(tl.int64), best_i)
                best = tl.where(take, chunk_max, best)
            pick = best_i


def max_min_select_triton(distances: torch.Tensor, seed: torch.Tensor, count: int,
                          block: int | None = None) -> torch.Tensor:
    """(count,) int64 picks in the order picked. distances: (N, N) float32, contiguous, diagonal -1 (a picked row
    stays below every other); seed: a 1-element int64 tensor on the same device, the first pick; block: rows a
    program holds at once (tests set it small to reach the scratch path), by default all of them up to
    MAX_BLOCK."""
    n = distances.shape[0]
    if distances.shape != (n, n) or distances.dtype != torch.float32 or not distances.is_contiguous():
        raise ValueError(f"distances must be a contiguous (N, N) float32 matrix, got {distances.dtype} "
                         f"{tuple(distances.shape)}")
    if not 1 <= count <= n:
        raise ValueError(f"count must be in [1, {n}], got {count}")
    block = block or min(triton.next_power_of_2(n), MAX_BLOCK)
    in_registers = n <= block
    out = torch.empty(count, dtype=torch.int64, device=distances.device)
    scratch = distances.new_empty(1 if in_registers else n)
    _max_min_select_kernel[(1,)](distances, seed.reshape(1), out, scratch, n, count, BLOCK=block,
                                 IN_REGISTERS=in_registers, num_warps=min(16, max(4, block // 512)))
    return out
