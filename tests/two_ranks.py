"""Run a function on two ranks of a gloo process group on the CPU, for the chapter 8 tests.

`on_two_ranks(worker, *args)` forks two processes (forked, not spawned: they inherit the
imported modules, so a run takes seconds), joins them in a gloo process group on a free local
port, calls `worker(rank, *args)` in each and returns the two results (anything `torch.save`
takes), rank 0's first. An exception in either rank fails the call with that rank's traceback;
a run that outlives `timeout` (a hang: ranks whose collectives do not pair up) is killed.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker: Callable, port: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks share the cores; a forked child re-creates its pool
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        result = worker(rank, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out) / f"{rank}.pt")


def on_two_ranks(worker: Callable, *args: Any, timeout: float = 240) -> list[Any]:
    """`[worker(0, *args), worker(1, *args)]`, each run in its own process of a gloo group."""
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _entry,
            args=(worker, free_port(), out, args),
            nprocs=WORLD_SIZE,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        os.kill(process.pid, 9)
                raise TimeoutError(f"the two ranks ran past {timeout} s (a hang?)")
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]
