"""Data parallelism by hand: every rank holds the whole model, trains on its own slice of the
batch, and the ranks average their gradients before each optimizer step, so every rank takes
the same step, the one a single process would take on the whole batch.

`DataParallel` does what PyTorch's `DistributedDataParallel` does, in the open:

1. At construction, rank 0's parameters (and buffers) are broadcast, so every rank starts
   from the same weights.
2. During the backward, as soon as a parameter's gradient is complete (its
   `register_post_accumulate_grad_hook` fires), an asynchronous all-reduce of it is started:
   the communication overlaps with the rest of the backward instead of following it.
3. With `bucket_size_mb`, gradients travel in buckets of about that size (fewer, larger
   messages: each collective has a fixed latency). Buckets hold the parameters in reverse
   order, the order in which the backward produces their gradients, and a bucket leaves as
   soon as every gradient in it is ready.
4. `finish_gradient_synchronization()`, after `backward()` and before `optimizer.step()`,
   waits for the all-reduces and writes the averaged gradients back.

Every rank must start the same collectives in the same order, or they pair up wrongly (and hang).
So buckets are started strictly in order: a bucket that is ready waits for the ones before it.
A parameter that gets no gradient (unused in this forward) leaves its bucket incomplete; such
buckets go at `finish_gradient_synchronization()`, with a flag per parameter saying which ranks
had a gradient. A parameter no rank used keeps `grad = None` (the optimizer skips it, as it
would in one process); one that some ranks used gets their sum divided by the world size,
as for every other gradient. A parameter shared by two modules (tied embeddings) is one
tensor, whose hook fires once per backward with the sum of both uses: it is reduced once.
Parameters with `requires_grad=False` are broadcast at construction and never reduced.

Gloo (CPU) and NCCL (CUDA) process groups both work; the gradients are divided by the world size
before the sum (gloo has no averaging all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from transformer_course import validate

__all__ = ["require_process_group", "check_same_parameters", "make_buckets", "DataParallel"]


def require_process_group() -> tuple[int, int]:
    """This process's rank and the world size, or a clear error without a process group.

    Course: chapter 8.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed: expected an initialised process group, got none; call "
            "torch.distributed.init_process_group('gloo') (CPU) or ('nccl') (CUDA) on every "
            "rank first, or launch with torchrun"
        )
    return dist.get_rank(), dist.get_world_size()


def check_same_parameters(module: nn.Module, name: str = "module") -> None:
    """Every rank's `module` has the same parameters: names, shapes, dtypes and `requires_grad`,
    in the same order. Raises the same ValueError on every rank (naming the first parameter that
    differs) instead of letting mismatched collectives hang. The values may differ: they are
    what the broadcast from rank 0 makes equal.

    Course: chapter 8.
    """
    _, world_size = require_process_group()
    mine = [
        (key, tuple(p.shape), str(p.dtype), p.requires_grad) for key, p in module.named_parameters()
    ]
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine)
    for other, theirs in enumerate(everyone):
        if theirs == everyone[0]:
            continue
        for index in range(max(len(theirs), len(everyone[0]))):
            a = everyone[0][index] if index < len(everyone[0]) else None
            b = theirs[index] if index < len(theirs) else None
            if a != b:
                raise ValueError(
                    f"{name}: expected the same parameters on every rank; parameter {index} is "
                    f"{_describe(a)} on rank 0 but {_describe(b)} on rank {other}. Build the same "
                    "model on every rank."
                )


def make_buckets(params: list[Tensor], bucket_size_mb: float | None) -> list[list[Tensor]]:
    """`params` (in the order their gradients will arrive) cut into consecutive buckets of at
    most `bucket_size_mb` MiB of gradients each: a parameter larger than that alone, a new
    bucket wherever the dtype changes (one bucket is one flat tensor). Without a size, one
    bucket per parameter.

    Course: chapter 8, exercise 8.6, checked by checks.data_parallel.check_make_buckets.
    """
    if bucket_size_mb is None:
        return [[p] for p in params]
    validate.number("bucket_size_mb", bucket_size_mb, low=0, low_open=True)
    limit = bucket_size_mb * 2**20
    buckets: list[list[Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not buckets or size + nbytes > limit or buckets[-1][0].dtype != p.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


def _describe(entry: tuple | None) -> str:
    if entry is None:
        return "missing"
    key, shape, dtype, requires_grad = entry
    return f"{key!r} of shape {shape}, {dtype}, requires_grad={requires_grad}"


@dataclass
class _Bucket:
    """Parameters whose gradients travel in one all-reduce, and its state in this step."""

    params: list[nn.Parameter]
    ready: int = 0  # how many of them have their gradient this step
    flat: Tensor | None = None  # their gradients in one vector, then one flag each
    work: Any = None  # the all-reduce in flight
    names: list[str] = field(default_factory=list)


class DataParallel(nn.Module):
    """Wrap `module` for data-parallel training on an initialised `torch.distributed` process
    group: rank 0's weights are broadcast now, and each backward's gradients are averaged
    across ranks while the backward runs (bucketed by `bucket_size_mb` when given).

        model = DataParallel(GPT2(cfg), bucket_size_mb=25)
        loss = lm_loss(model(tokens), targets)   # each rank: its own slice of the batch
        loss.backward()
        model.finish_gradient_synchronization()  # after backward(), before step()
        optimizer.step()

    Course: chapter 8, exercise 8.7, checked by checks.data_parallel.check_data_parallel.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = None) -> None:
        super().__init__()
        self.rank, self.world_size = require_process_group()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        names = {p: key for key, p in module.named_parameters()}  # a shared one: its first name
        params = [p for p in module.parameters() if p.requires_grad]  # each tensor once
        self._buckets = [_Bucket(b) for b in make_buckets(params[::-1], bucket_size_mb)]
        for bucket in self._buckets:
            bucket.names = [names[p] for p in bucket.params]
        check_same_parameters(module)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        self._bucket_of = {p: b for b in self._buckets for p in b.params}
        self._has_grad: set[nn.Parameter] = set()
        self._next = 0  # the first bucket not started yet
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._has_grad or self._next:
            raise RuntimeError(
                "DataParallel: the last backward's gradients are still being averaged; call "
                "finish_gradient_synchronization() after every backward(), before step()"
            )
        return self.module(*args, **kwargs)

    def _grad_ready(self, param: nn.Parameter) -> None:
        """A parameter's gradient is complete: count it, and start every bucket now full."""
        bucket = self._bucket_of[param]
        if param in self._has_grad:
            name = bucket.names[bucket.params.index(param)]
            raise RuntimeError(
                f"DataParallel: a second gradient for {name!r} before "
                "finish_gradient_synchronization(); call it after every backward()"
            )
        self._has_grad.add(param)
        bucket.ready += 1
        while self._next < len(self._buckets):  # in order: every rank starts the same sequence
            bucket = self._buckets[self._next]
            if bucket.ready < len(bucket.params):
                break
            self._start(bucket)
            self._next += 1

    def _start(self, bucket: _Bucket) -> None:
        """All-reduce the bucket's gradients, divided by the world size, and one flag per
        parameter that counts the ranks that had its gradient (a missing one counts as 0)."""
        first = bucket.params[0]
        grads = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in bucket.params
        ]
        flags = torch.tensor([p.grad is not None for p in bucket.params], device=first.device)
        bucket.flat = torch.cat([*grads, flags.to(first.dtype)])
        bucket.flat[: -len(bucket.params)].div_(self.world_size)
        bucket.work = dist.all_reduce(bucket.flat, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce (starting those still waiting for a gradient that
        never came) and set each parameter's gradient to the average over ranks.

        Course: chapter 8.
        """
        for bucket in self._buckets[self._next :]:
            self._start(bucket)
        for bucket in self._buckets:
            bucket.work.wait()
            n = len(bucket.params)
            chunks = bucket.flat[:-n].split([p.numel() for p in bucket.params])
            for p, chunk, ranks in zip(bucket.params, chunks, bucket.flat[-n:].tolist()):
                if p.grad is not None:
                    p.grad.copy_(chunk.view_as(p))
                elif ranks > 0:  # unused here, used on another rank
                    p.grad = chunk.view_as(p).clone()
            bucket.ready, bucket.flat, bucket.work = 0, None, None
        self._has_grad.clear()
        self._next = 0
