"""Checkers for chapter 8's data parallelism (08_scaling, 8.6-8.7): gradient buckets, and
`DataParallel` on two gloo processes forked on the CPU against one process trained on the whole
batch. The two-rank harness here (`on_two_ranks`, `train`, ...) serves `checks.sharded` too."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from transformer_course import data_parallel
from transformer_course.checks.harness import (
    CheckFailure,
    call,
    describe,
    expect,
    expect_close,
    passed,
    seeded,
)
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss
from transformer_course.ranks import on_ranks


def _bucket_variant(params, bucket_size_mb, *, mib=2**20, size=None, dtype=True, fit=True):
    """`make_buckets` with one knob turned: MiB as 10^6 bytes, sizes in elements, dtypes
    mixed in a bucket, or a parameter that exactly fills a bucket sent to the next."""
    if bucket_size_mb is None:
        return [[p] for p in params]
    limit, buckets, used = bucket_size_mb * mib, [], 0
    for p in params:
        nbytes = size(p) if size else p.numel() * p.element_size()
        full = used + nbytes > limit if fit else used + nbytes >= limit
        if not buckets or full or (dtype and buckets[-1][0].dtype != p.dtype):
            buckets.append([])
            used = 0
        buckets[-1].append(p)
        used += nbytes
    return buckets


def check_make_buckets(make_buckets: Callable) -> None:
    """Buckets of consecutive parameters: sizes in bytes (MiB = 2^20), a parameter that fills
    a bucket exactly stays in it, a larger one alone, a new bucket at each change of dtype."""
    kib = 2**10 / 2**20  # one KiB, in MiB
    # In bytes: 256 + 768 fill 1 KiB exactly; 400 + 612 fit in 1 KiB but not in 1000 bytes; the
    # float64 400 + 800 do not fit (at 4 bytes an element they would); a dtype change; 1200 alone.
    sizes = [
        (64, torch.float32),
        (192, torch.float32),
        (100, torch.float32),
        (153, torch.float32),
        (50, torch.float64),
        (100, torch.float64),
        (300, torch.float32),
        (5, torch.float32),
    ]
    params = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
    index = {id(p): i for i, p in enumerate(params)}
    as_indices = lambda buckets: [[index.get(id(p), -1) for p in b] for b in buckets]
    for bucket_size_mb in (None, kib, 1.5 * kib, 4 * kib):
        where = f"make_buckets(params, bucket_size_mb={bucket_size_mb})"
        got = call(where, make_buckets, list(params), bucket_size_mb)
        ok = isinstance(got, list) and all(isinstance(b, list) for b in got)
        expect(ok, where, f"expected a list of lists of parameters, got {describe(got)}.")
        got = as_indices(got)
        expected = as_indices(data_parallel.make_buckets(params, bucket_size_mb))
        mistakes = {
            "a MiB is 2**20 bytes, not 10**6.": dict(mib=10**6),
            "measure in bytes: numel() * element_size() (a float64 takes 8).": dict(
                size=lambda p: p.numel()
            ),
            "a float64 element takes 8 bytes: numel() * element_size(), not numel() * 4.": dict(
                size=lambda p: 4 * p.numel()
            ),
            "a bucket is one flat tensor: start a new one where the dtype changes.": dict(
                dtype=False
            ),
            "a parameter that exactly fills the bucket belongs in it: a new bucket only when "
            "the size would pass bucket_size_mb.": dict(fit=False),
        }
        for hint, knobs in mistakes.items():
            wrong = as_indices(_bucket_variant(params, bucket_size_mb, **knobs))
            if wrong != expected:
                expect(got != wrong, where, f"expected buckets {expected}, got {got}.", hint)
        hint = "walk the parameters in order, adding each to the last bucket while it fits."
        expect(got == expected, where, f"expected buckets {expected}, got {got} (indices).", hint)
    passed("make_buckets")


# ---- two ranks ---------------------------------------------------------------------------

RANKS_TIMEOUT = 90  # seconds: a check on two ranks takes a few
HANG_HINT = "every rank must start the same collectives, in the same order, on tensors of the "
HANG_HINT += "same size; a rank that skips one (or waits for one the other never starts) hangs."


def _guarded(rank: int, notes: str, worker: Callable, *args: Any) -> Any:
    """`worker(rank, *args)`; a failed check is written to `notes` and ends this rank at once,
    so that the other rank's collectives fail now instead of waiting for it until a timeout."""
    try:
        return worker(rank, *args)
    except CheckFailure as failure:  # rank 0's is reported first; another rank's says which
        message = str(failure) if rank == 0 else f"{failure} (on rank {rank})"
        (Path(notes) / f"{rank}.txt").write_text(message)
        os._exit(1)


def on_two_ranks(name: str, worker: Callable, *args: Any) -> list[Any]:
    """`worker(rank, *args)` on two gloo ranks; a failure, a crash or a hang as a CheckFailure."""
    with tempfile.TemporaryDirectory() as notes:
        try:
            return on_ranks(_guarded, notes, worker, *args, timeout=RANKS_TIMEOUT)
        except Exception as exc:  # a rank's failed check, a crash or a hang
            failed = sorted(Path(notes).glob("*.txt"))
            if failed:
                raise CheckFailure(failed[0].read_text()) from None
            if isinstance(exc, TimeoutError):
                problem = f"the two ranks were still running after {RANKS_TIMEOUT} s: a hang."
            else:
                problem = f"a rank crashed: {str(exc).strip().splitlines()[-1]}"
            raise CheckFailure(f"`{name}`: {problem}\nHint: {HANG_HINT}") from None


DIST_CFG = GPT2Config(d_model=16, n_layers=1, n_heads=2, d_vocab=29, n_ctx=8, tie_embeddings=True)
STEPS, BATCH, SEQ, LR = 3, 4, 6, 0.5


def _batches() -> list[tuple[Tensor, Tensor]]:
    data = torch.randint(0, DIST_CFG.d_vocab, (STEPS, BATCH, SEQ + 1), generator=seeded(7))
    return [(d[:, :-1], d[:, 1:]) for d in data]


def initial_model() -> GPT2:
    """GPT-2 at seed 0: rank 0's weights, which the wrapper broadcasts to every rank, and so the
    weights one process trains from for reference."""
    torch.manual_seed(0)
    return GPT2(DIST_CFG)


def train(
    model: nn.Module,
    rank: int | None,
    finish: Callable | None,
    *,
    lr: float = LR,
    optimizer: Any = None,
) -> dict[str, Tensor]:
    """SGD steps on the batches (on rank r's half of each if `rank` is given)."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    for tokens, targets in _batches():
        if rank is not None:
            half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
            tokens, targets = tokens[half], targets[half]
        loss = lm_loss(model(tokens), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Branchy(nn.Module):
    """A matrix used twice, a frozen one, one never used, one used only where asked."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Parameter(torch.randn(4, 4))
        self.frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(4))
        self.sometimes = nn.Parameter(torch.randn(4, 4))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x: Tensor, use_sometimes: bool) -> Tensor:
        h = torch.tanh(x @ self.shared @ self.frozen) @ self.shared + self.bias
        return h @ self.sometimes if use_sometimes else h


def _branchy_grads(model: nn.Module, rank: int, finish: Callable | None) -> dict:
    x = torch.randn(3, 4, generator=seeded(10 + rank))
    model(x, use_sometimes=rank == 0).pow(2).sum().backward()
    if finish is not None:
        finish()
    inner = getattr(model, "module", model)
    return {n: None if p.grad is None else p.grad.clone() for n, p in inner.named_parameters()}


def finisher_of(where: str, wrapper: nn.Module) -> Callable[[], None]:
    """The learner's `wrapper.finish_gradient_synchronization`, a crash reported as a check."""
    name = f"{where}.finish_gradient_synchronization"
    return lambda: call(name, wrapper.finish_gradient_synchronization)


class _AllReduces:
    """Record, while in use, how each `dist.all_reduce` is started (`async_op`, in the backward
    or in `finish_gradient_synchronization`) and where its work is waited on."""

    def __init__(self) -> None:
        self.phase, self.started, self.waited = "backward", [], []

    def finisher(self, finish: Callable[[], None]) -> Callable[[], None]:
        """`finish`, with the phase it runs in recorded."""

        def run() -> None:
            self.phase = "finish"
            finish()
            self.phase = "backward"

        return run

    def __enter__(self) -> _AllReduces:
        self._original = dist.all_reduce

        def all_reduce(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            asynchronous = bool(kwargs.get("async_op", args[2] if len(args) > 2 else False))
            self.started.append((self.phase, asynchronous))
            work = self._original(tensor, *args, **kwargs)
            return _RecordedWork(work, self) if work is not None else None

        dist.all_reduce = all_reduce
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._original


class _RecordedWork:
    """A collective's work that notes the phase its `wait()` is called in."""

    def __init__(self, work: Any, record: _AllReduces) -> None:
        self._work, self._record = work, record

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._record.waited.append(self._record.phase)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _data_parallel_worker(rank: int, cls: type) -> dict:
    results = {}
    for bucket_size_mb in (None, 0.002):
        where = f"DataParallel(GPT2, bucket_size_mb={bucket_size_mb})"
        torch.manual_seed(rank)  # each rank its own weights: the broadcast must fix that
        model = GPT2(DIST_CFG)
        dp = call(where, cls, model, bucket_size_mb=bucket_size_mb)
        with _AllReduces() as record:
            finish = record.finisher(finisher_of(where, dp))
            results[bucket_size_mb] = _train_wrapped(dp, rank, finish)
        results[f"all-reduces {bucket_size_mb}"] = (record.started, record.waited)
        torch.manual_seed(rank)
        branchy = call(where, cls, Branchy(), bucket_size_mb=bucket_size_mb)
        finish = finisher_of(where, branchy)
        results[f"branchy {bucket_size_mb}"] = _branchy_grads(branchy, rank, finish)
    return results


def _train_wrapped(dp: nn.Module, rank: int, finish: Callable) -> dict[str, Tensor]:
    """`train` through the wrapper (its forward), the state read from the inner module."""
    optimizer = torch.optim.SGD(dp.module.parameters(), lr=LR)
    try:
        train(dp, rank, finish, optimizer=optimizer)
    except RuntimeError as error:
        if "still being averaged" not in str(error):
            raise
        problem = "the second step's forward found the first step's state still there."
        hint = "finish_gradient_synchronization() ends the step: reset each bucket's ready, "
        hint += "flat and work, self._has_grad and self._next."
        raise CheckFailure(f"`DataParallel`: {problem}\nHint: {hint}") from None
    return {k: v.detach().clone() for k, v in dp.module.state_dict().items()}


def expect_states(where: str, got: dict, expected: dict, mistakes: dict, atol: float) -> None:
    """Every tensor of a state dict against the expected one; a known mistake named."""
    hint = f"after {STEPS} steps the weights differ from one process's."
    for key, value in expected.items():
        wrong = {mistake: state[key] for mistake, state in mistakes.items()}
        expect_close(got[key], value, f"{where}: {key}", hint, atol=atol, mistakes=wrong)


def check_data_parallel(cls: type) -> None:
    """On two gloo ranks: rank 0's weights broadcast; after 3 SGD steps on each rank's half of
    the batch, the weights of one process trained on the whole batch (1e-5), bucketed and not;
    a shared matrix reduced once, unused parameters without gradient, one used on one rank
    averaged over both; each all-reduce started with async_op=True in the backward and waited
    on in finish_gradient_synchronization."""
    results = on_two_ranks("DataParallel", _data_parallel_worker, cls)
    expected = train(initial_model(), None, None)
    mistakes = {
        "the gradients were summed, not averaged: divide by the world size.": train(
            initial_model(), None, None, lr=2 * LR
        ),
        "each rank stepped on its own half only: write the averaged gradient back into each "
        "parameter's .grad once its all-reduce is done.": train(initial_model(), 0, None),
    }
    for bucket_size_mb in (None, 0.002):
        where = f"DataParallel(bucket_size_mb={bucket_size_mb}), rank 0"
        expect_states(where, results[0][bucket_size_mb], expected, mistakes, atol=1e-5)
        for key, value in results[0][bucket_size_mb].items():
            same = torch.equal(value, results[1][bucket_size_mb][key])
            expect(
                same,
                f"DataParallel(bucket_size_mb={bucket_size_mb})",
                f"the ranks' `{key}` differ after training.",
                "every rank must end each step with the same averaged gradients.",
            )
        started, waited = results[0][f"all-reduces {bucket_size_mb}"]
        where = f"DataParallel(bucket_size_mb={bucket_size_mb})"
        blocking = [phase for phase, asynchronous in started if not asynchronous]
        problem = f"{len(blocking)} of its {len(started)} all-reduces blocked until done."
        hint = "start each bucket's all-reduce with dist.all_reduce(flat, async_op=True) and keep "
        hint += "the work in bucket.work: the backward then goes on while it runs."
        expect(not blocking, where, problem, hint)
        problem = "every all-reduce started in finish_gradient_synchronization, after the backward."
        hint = "_start(bucket) starts the bucket's all-reduce as soon as it is full (in the "
        hint += "backward); finish_gradient_synchronization only starts the buckets still waiting."
        # none recorded: the answer calls an all_reduce imported by name, which goes unseen
        in_backward = not started or any(phase == "backward" for phase, _ in started)
        expect(in_backward, where, problem, hint)
        early = waited.count("backward")
        problem = f"{early} all-reduces were waited on during the backward, in _start."
        hint = "wait for bucket.work in finish_gradient_synchronization: waiting in _start "
        hint += "leaves nothing to overlap with the rest of the backward."
        expect(not early, where, problem, hint)
    own = []  # each rank's own gradients, from rank 0's weights
    for rank in (0, 1):
        torch.manual_seed(0)
        own.append(_branchy_grads(Branchy(), rank, None))
    for bucket_size_mb in (None, 0.002):
        where = f"DataParallel(bucket_size_mb={bucket_size_mb}), a model with a shared matrix"
        got = results[0][f"branchy {bucket_size_mb}"]
        for name in ("frozen", "unused"):
            hint = "a parameter no rank used keeps grad None (the optimizer then skips it)."
            expect(
                got[name] is None,
                f"{where}: {name}",
                f"expected no gradient, got {describe(got[name])}.",
                hint,
            )
        for name in ("shared", "bias"):
            wanted = (own[0][name] + own[1][name]) / 2
            hint = "a parameter used twice has one gradient (the sum of both uses): reduce it once."
            expect_close(got[name], wanted, f"{where}: {name}", hint, atol=1e-5)
        wanted = own[0]["sometimes"] / 2
        hint = "used on rank 0 only: rank 1's gradient counts as zero, and the sum is divided by "
        hint += "the world size like every other."
        expect(
            got["sometimes"] is not None,
            f"{where}: sometimes",
            "used on rank 0 only, it got no gradient on rank 0.",
            hint,
        )
        expect_close(
            got["sometimes"],
            wanted,
            f"{where}: sometimes",
            hint,
            atol=1e-5,
            mistakes={hint: own[0]["sometimes"]},
        )
    passed("DataParallel")
