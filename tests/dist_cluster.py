"""A few long-lived worker processes forming a gloo world, to run test functions on every rank.

Starting processes that import torch costs seconds each, so a test module starts one cluster and sends
it many functions. A function runs on every rank at once; `run` returns each rank's result or the
exception it raised. A rank that hangs past `timeout` fails the test and the cluster is torn down.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    trace: str = ""

    def get(self) -> Any:
        if self.error is not None:
            raise AssertionError(f"rank raised:\n{self.trace}") from self.error
        return self.value


def _serve(rank: int, world: int, init_file: str, tasks: Any, results: Any, backend: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share CI's two cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, Outcome(fn(*args))))
        except BaseException as e:  # noqa: B036 - report everything to the parent
            try:
                results.put((rank, Outcome(error=e, trace=traceback.format_exc())))
            except Exception:  # an exception that does not pickle
                results.put((rank, Outcome(error=RuntimeError(repr(e)), trace=traceback.format_exc())))
    # leave without tearing the groups down: gloo destructors can wait on peers that already left
    os._exit(0)


class Cluster:
    def __init__(self, world_size: int, workdir: Path, backend: str = "gloo"):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        init_file = str(workdir / "dist-init")
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, world_size, init_file, self.tasks[r], self.results, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn: Any, *args: Any, timeout: float = 120.0) -> list[Outcome]:
        """Run fn(*args) on every rank; fn must be importable (a module-level function)."""
        for q in self.tasks:
            q.put((fn, args))
        got: dict[int, Outcome] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world_size:
            try:
                rank, outcome = self.results.get(timeout=1.0)
                got[rank] = outcome
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    missing = sorted(set(range(self.world_size)) - set(got))
                    raise AssertionError(f"ranks {missing} hung or died") from None
        return [got[r] for r in range(self.world_size)]

    def values(self, fn: Any, *args: Any, timeout: float = 120.0) -> list[Any]:
        return [o.get() for o in self.run(fn, *args, timeout=timeout)]

    def close(self, force: bool = False) -> None:
        for p, q in zip(self.procs, self.tasks):
            if p.is_alive() and not force:
                q.put(None)
        for p in self.procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join()
