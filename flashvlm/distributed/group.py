"""One tensor-parallel group: its rank and size, and the few collectives the sharded layers and the engine use.

A group of size 1 is the same object with every collective the identity, so `--tensor-parallel-size 1` runs the
same engine code with no process group at all."""

from __future__ import annotations

import datetime
from typing import Any

import torch


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed (start-up, a step, a timed-out collective)."""


def _forget_failed_init() -> None:
    """torch names the default group from a process-wide counter, which a failed init_process_group has already
    advanced (distributed_c10d._process_group_name). The next engine's workers are fresh processes that name
    theirs '0', so rank 0, in the caller's process, would wait on another name and its rendezvous would time out.
    With no default group left, the counter goes back to where destroy_process_group leaves it."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0


class TPGroup:
    def __init__(self, rank: int = 0, size: int = 1, device_group: Any = None, cpu_group: Any = None) -> None:
        self.rank, self.size = rank, size
        self.device_group = device_group
        """The process group of the sharded layers' collectives (NCCL on GPUs, gloo on CPU); None at size 1."""
        self.cpu_group = cpu_group
        """A gloo group for host-side values (the KV blocks every rank agrees on)."""

    @classmethod
    def join(cls, rank: int, size: int, init_method: str, device: str, timeout_s: float) -> TPGroup:
        """Join the group (every rank calls this); blocks until all ranks have joined or `timeout_s` passed."""
        import torch.distributed as dist

        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
        except BaseException:
            _forget_failed_init()
            raise
        cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        return cls(rank, size, dist.group.WORLD, cpu_group)

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that schedules, samples for the caller and owns the worker processes."""
        return self.rank == 0

    # ---- the layers' collectives ------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.device_group)
        return x

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum over ranks, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (same shape on all), concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV blocks that fit on every rank)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def destroy(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
