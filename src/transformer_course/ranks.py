"""Run a function on several ranks of a gloo process group on this machine's CPU, for chapter 8's
checks, tests and capstone.

`on_ranks(worker, *args)` forks `world_size` processes (forked, not spawned: they inherit the
imported modules and a notebook's own functions and classes, so a run takes seconds), joins them
in a gloo process group on a free local port, calls `worker(rank, *args)` in each and returns the
results (anything `torch.save` takes), rank 0's first. An exception in a rank fails the call with
that rank's traceback; a run that outlives `timeout` seconds (a hang: ranks whose collectives do
not pair up) is killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from transformer_course import validate

__all__ = ["on_ranks", "CollectiveBytes"]

# The collectives the course's wrappers call: the kind each is counted under, and which of its
# arguments is the payload (the tensor reduced or broadcast, the whole tensor a gather fills,
# the whole one a scatter cuts).
PAYLOAD = {
    "all_reduce": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, worker: Callable, world_size: int, port: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the cores; a forked child re-creates its pool
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        result = worker(rank, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out) / f"{rank}.pt")


def on_ranks(worker: Callable, *args: Any, world_size: int = 2, timeout: float = 240) -> list[Any]:
    """`[worker(0, *args), worker(1, *args), ...]`, each run in its own process of a gloo group.

    Course: chapter 8.
    """
    validate.positive_int("world_size", world_size)
    validate.number("timeout", timeout, low=0, low_open=True)
    if "fork" not in multiprocessing.get_all_start_methods():
        raise RuntimeError(
            "on_ranks: expected a platform that can fork processes (Linux or macOS), got one "
            "that cannot; run the ranks with torchrun instead"
        )
    if dist.is_initialized():
        raise RuntimeError(
            "on_ranks: expected no process group in this process, got one; call it from a "
            "process that is not itself a rank"
        )
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _entry,
            args=(worker, world_size, _free_port(), out, args),
            nprocs=world_size,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + timeout
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        os.kill(process.pid, 9)
                raise TimeoutError(f"the {world_size} ranks ran past {timeout} s (a hang?)")
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world_size)]


class CollectiveBytes:
    """Count, inside a `with` block, the bytes this rank hands to each kind of collective:

        with CollectiveBytes() as sent:
            ...one training step...
        sent.bytes            # {"all_reduce": 1234, ...}, by kind of collective
        sent.calls            # {"all_reduce": 3, ...}: how many messages of each kind
        sent.total

    The payload of a collective is the tensor it works on: the one all-reduced or broadcast,
    the whole one an all-gather fills, the whole one a reduce-scatter cuts. (A ring algorithm
    moves about 2 (W-1)/W of an all-reduce's payload over each rank's link, and (W-1)/W of a
    gather's or a scatter's, with W ranks.) `paused()` stops the count for a while.

    Course: chapter 8.
    """

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._originals: dict[str, Callable] = {}
        self._counting = True

    def _counted(self, name: str, collective: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            if self._counting:
                kind, index = PAYLOAD[name]
                tensor = args[index]
                self.bytes[kind] = self.bytes.get(kind, 0) + tensor.numel() * tensor.element_size()
                self.calls[kind] = self.calls.get(kind, 0) + 1
            return collective(*args, **kwargs)

        return run

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A `with` block in which nothing is counted."""
        self._counting = False
        try:
            yield
        finally:
            self._counting = True

    def __enter__(self) -> CollectiveBytes:
        for name in PAYLOAD:
            if hasattr(dist, name):
                self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._counted(name, self._originals[name]))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, collective in self._originals.items():
            setattr(dist, name, collective)
        self._originals.clear()
