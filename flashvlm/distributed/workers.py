"""The worker processes of a tensor-parallel engine and rank 0's handle on them.

Rank 0 (the caller's process) spawns ranks 1..N-1; each builds the same engine (its own slice of the model, its
own KV cache) and then runs, step after step, the SchedulerOutput rank 0 sends: the same runner step, with
the same all-gathered logits and so the same samples, which only rank 0 reports. A worker that fails sends its
error back and exits, which breaks rank 0's next collective; rank 0 then raises TensorParallelError naming the
rank and its error. Collectives that wait longer than distributed_timeout_s fail the same way."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

from flashvlm.config import EngineConfig
from flashvlm.distributed.group import TensorParallelError, TPGroup
from flashvlm.distributed.step_messages import StepReceiver, StepSender

logger = logging.getLogger(__name__)

_STOP = "stop"
_START_S = 300.0
"""Least time a worker is given to import flashvlm and torch before it joins (a busy host is slow at that); a
worker that dies meanwhile is reported at once."""


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: cuda:r on GPUs (device 'cuda' or 'cuda:0'), the CPU as it is."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


class TensorParallel:
    """Rank 0's group and worker processes; at size 1 a group of one and no processes."""

    def __init__(self, group: TPGroup, processes: list[Any], pipes: list[Any], workdir: Path | None,
                 commands: list[Any] | None = None) -> None:
        self.group, self.processes, self.pipes, self.workdir = group, processes, pipes, workdir
        """`pipes`: each worker's reports (started, its error); `commands`: rank 0's step messages to it."""
        self.commands = commands if commands is not None else []
        self._closed = False
        self._sender = StepSender()
        self._finalizer = weakref.finalize(self, _stop_processes, processes, 0.0)

    @classmethod
    def start(cls, config: EngineConfig) -> TensorParallel:
        """Spawn ranks 1..N-1 and join the group with them; a worker failing at start-up raises here."""
        size = config.tensor_parallel_size
        if size == 1:
            return cls(TPGroup(), [], [], None)
        workdir = Path(tempfile.mkdtemp(prefix="flashvlm-tp-"))
        init_method = f"file://{workdir / 'rendezvous'}"
        ctx = mp.get_context("spawn")
        processes, pipes, commands = [], [], []
        tp = cls(TPGroup(0, size), processes, pipes, workdir, commands)
        try:
            for rank in range(1, size):
                reports, report_end = ctx.Pipe(duplex=False)
                command_end, command = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=worker_main, args=(config, rank, init_method, report_end, command_end),
                                   name=f"flashvlm-tp-rank{rank}", daemon=True)
                proc.start()
                report_end.close()
                command_end.close()
                processes.append(proc)
                pipes.append(reports)
                commands.append(command)
            tp._wait_started(max(config.distributed_timeout_s, _START_S))
            tp.group = TPGroup.join(0, size, init_method, config.device, config.distributed_timeout_s)
        except BaseException as e:
            # A worker that fails while the group is being joined breaks or stalls rank 0's rendezvous (a gloo
            # error, or the store's wait timing out): the worker's own message says why.
            message = None if isinstance(e, TensorParallelError) else tp.failure()
            tp.close(graceful=False)
            if message is not None:
                raise TensorParallelError(message) from e
            raise
        return tp

    def _wait_started(self, timeout_s: float) -> None:
        """Each worker says it is about to join (its imports done): a worker that dies before is reported here
        rather than as a rendezvous timeout."""
        deadline = time.monotonic() + timeout_s
        for rank, (proc, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            while not pipe.poll(0.05):
                if not proc.is_alive():
                    raise TensorParallelError(self.failure() or f"rank {rank} exited while starting")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"rank {rank} did not start within {timeout_s}s")
            try:
                kind, message = pipe.recv()
            except EOFError:  # it exited without a word (e.g. it could not import the caller's main module)
                proc.join(5.0)
                raise TensorParallelError(f"tensor-parallel rank {rank} exited while starting (code "
                                          f"{proc.exitcode}); a script that starts one must guard its entry point "
                                          "with if __name__ == '__main__' (multiprocessing spawn)") from None
            if kind == "error":
                raise TensorParallelError(message)

    # ---- per step ---------------------------------------------------------------------------------
    def broadcast_step(self, out: Any, forgotten: list[str]) -> None:
        """The step to every worker, through its command pipe rather than a collective: a worker waits for its
        next step as long as the engine idles, with no collective timeout, and sees EOF if rank 0 dies."""
        if self.group.size > 1:
            if self._closed:
                raise TensorParallelError("the tensor-parallel workers were stopped after an earlier failure: "
                                          "start a new engine")
            self._send(pickle.dumps(self._sender.message(out, forgotten), protocol=pickle.HIGHEST_PROTOCOL))

    def _send(self, data: bytes) -> None:
        for command in self.commands:
            command.send_bytes(data)

    def failure(self) -> str | None:
        """A failed worker's own message (or its exit code), or None while every worker runs. A worker sends its
        message before it exits, so by the time rank 0's collective breaks the message is there."""
        for _ in range(20):
            for pipe in self.pipes:
                try:
                    if pipe.poll():
                        kind, message = pipe.recv()
                        if kind == "error":
                            return message
                except (EOFError, OSError):
                    pass
            dead = [(r, p) for r, p in enumerate(self.processes, start=1) if not p.is_alive()]
            if dead and all(not p.poll() for p in self.pipes):
                rank, proc = dead[0]
                return f"tensor-parallel rank {rank} exited with code {proc.exitcode}"
            if not dead:
                time.sleep(0.025)  # a dying worker may not have been reaped yet
        return None

    def check(self, error: BaseException) -> None:
        """After `error` on rank 0, before the engine re-raises it: the workers are stopped (they may wait in a
        step rank 0 left, so the group is of no further use), and a broken collective or pipe, whose cause is on
        another rank, becomes TensorParallelError with that rank's own message. Any other error is rank 0's own
        and is left to propagate."""
        if self.group.size == 1:
            return
        message = self.failure() if _is_collective_error(error) else None
        self.close(graceful=False)
        if _is_collective_error(error):
            raise TensorParallelError(message or f"a tensor-parallel collective failed: {error}") from error

    # ---- shutdown ---------------------------------------------------------------------------------
    def close(self, graceful: bool = False) -> None:
        """Stop the workers and leave the group. graceful: between steps, where every worker waits for rank 0's
        next message: a stop message, then they exit; else (after a failure) they are terminated."""
        if self._closed:
            return
        self._closed = True
        if graceful and self.group.size > 1 and all(p.is_alive() for p in self.processes):
            try:
                self._send(pickle.dumps(_STOP))
            except OSError:  # a broken pipe: the workers are terminated below
                logger.warning("tensor-parallel workers did not take the stop message; terminating them")
        _stop_processes(self.processes, 10.0 if graceful else 0.0)
        self.group.destroy()
        if self.workdir is not None:
            for f in self.workdir.glob("*"):
                f.unlink(missing_ok=True)
            self.workdir.rmdir()
        self._finalizer.detach()


def _is_collective_error(error: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(error, (dist.DistError, BrokenPipeError, ConnectionError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("gloo" in text or "nccl" in text)


def _stop_processes(processes: list[Any], grace_s: float = 10.0) -> None:
    deadline = time.monotonic() + grace_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()


def worker_main(config: EngineConfig, rank: int, init_method: str, pipe: Any, commands: Any) -> None:
    """Rank `rank`: build the engine's device side, then run rank 0's steps until it says stop."""
    try:
        from flashvlm.engine.engine import Engine

        config = dataclasses.replace(config, device=rank_device(config.device, rank))
        if config.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(config.device)
        pipe.send(("started", None))
        group = TPGroup.join(rank, config.tensor_parallel_size, init_method, config.device,
                             config.distributed_timeout_s)
        engine = Engine(config, tp=TensorParallel(group, [], [], None))
        receiver = StepReceiver()
        while True:
            try:
                message = pickle.loads(commands.recv_bytes())
            except EOFError:  # rank 0 is gone
                break
            if message == _STOP:
                break
            engine.run_worker_step(*receiver.receive(message))
        group.destroy()
        pipe.close()
        os._exit(0)  # past the group's C++ threads' teardown at interpreter exit, which can abort the process
    except BaseException as e:  # noqa: BLE001 - every failure goes back to rank 0
        message = f"tensor-parallel rank {rank} failed: {type(e).__name__}: {e}"
        logger.error("%s\n%s", message, traceback.format_exc())
        with contextlib.suppress(OSError):
            pipe.send(("error", message))
        os._exit(1)  # leaves the group at once, so rank 0's next collective fails instead of waiting
