"""Worker entry points that fail on purpose, for the tensor-parallel failure tests: each patches the spawned
worker's own Engine (the parent's is untouched) and then runs the real worker_main. Importable by the spawned
worker: pytest puts this folder on sys.path, and spawn hands the parent's sys.path to its children."""

from __future__ import annotations

import time
from typing import Any


def faulty_worker(where: str, config: Any, rank: int, *args: Any) -> None:
    """worker_main, with rank 1 failing at `where`: "join" (before it joins the group, so rank 0's rendezvous
    waits for it), "startup" (building its engine), "step:N" (raising in its Nth step) or "hang-step:N" (its Nth
    step never returning)."""
    from flashvlm.distributed import workers
    from flashvlm.engine.engine import Engine

    if rank == 1:
        if where == "join":
            from flashvlm.distributed.group import TPGroup

            def refuse_join(*_: Any, **__: Any) -> None:
                raise RuntimeError("injected fault at join")

            TPGroup.join = refuse_join  # type: ignore[method-assign,assignment]
        elif where == "startup":
            def refuse(*_: Any, **__: Any) -> None:
                raise RuntimeError("injected fault at startup")

            Engine.__init__ = refuse  # type: ignore[method-assign]
        else:
            kind, n = where.rsplit(":", 1)
            real, steps = Engine.run_worker_step, [0]

            def step(self: Engine, *step_args: Any) -> None:
                steps[0] += 1
                if steps[0] == int(n):
                    if kind == "hang-step":
                        time.sleep(3600)  # stops answering: rank 0's collective times out
                    raise RuntimeError(f"injected fault at step {n}")
                real(self, *step_args)

            Engine.run_worker_step = step  # type: ignore[method-assign]
    workers.worker_main(config, rank, *args)
