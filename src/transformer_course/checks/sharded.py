"""Checkers for chapter 8's sharding (08_scaling, 8.8-8.9): the sharded optimizer (ZeRO stage 1)
and FSDP, each on two gloo processes forked on the CPU against unsharded training."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from transformer_course.checks.data_parallel import (
    DIST_CFG,
    LR,
    expect_states,
    finisher_of,
    initial_model,
    on_two_ranks,
    train,
)
from transformer_course.checks.harness import call, expect, expect_close, passed, seeded
from transformer_course.gpt2 import GPT2
from transformer_course.ranks import CollectiveBytes


def _toy() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def _groups(model: nn.Module) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [
        {"params": weights, "weight_decay": 0.1},
        {"params": biases, "lr": 0.02, "weight_decay": 0.01},
    ]


def _optimize(model: nn.Module, optimizer: Any, schedule: tuple[str, ...] = ("lr", "weight_decay")):
    """Three steps on one batch, halving each group's settings in `schedule` after each step
    (a schedule); the final weights."""
    x, y = torch.randn(8, 6, generator=seeded(4)), torch.randn(8, 3, generator=seeded(5))
    for _ in range(3):
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        for group in optimizer.param_groups:
            for setting in schedule:
                group[setting] *= 0.5
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, dict(lr=0.01)),
    "SGD with momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
}


def _params_with_state(optimizer: Any) -> set[int]:
    """The ids of the parameters for which `optimizer`, or an optimizer it holds, keeps state."""
    kept = set()
    for held in [optimizer, *vars(optimizer).values()]:
        if isinstance(held, torch.optim.Optimizer):
            kept |= {id(p) for p, state in held.state.items() if state}
    return kept


def _sharded_worker(rank: int, cls: type) -> dict:
    results = {}
    for label, (optimizer_cls, kwargs) in OPTIMIZERS.items():
        model = _toy()  # the same weights and the same batch on both ranks
        where = f"ShardedOptimizer(groups, {optimizer_cls.__name__}, ...)"
        optimizer = call(where, cls, _groups(model), optimizer_cls, **kwargs)
        step = optimizer.step
        optimizer.step = lambda step=step, where=where: call(f"{where}.step", step)
        results[label] = _optimize(model, optimizer)
        kept = _params_with_state(optimizer)
        owners = getattr(optimizer, "owner", {})
        results[f"{label} state"] = [
            n for n, p in model.named_parameters() if id(p) in kept and owners.get(p) != rank
        ]
    lone = nn.Parameter(torch.ones(3))  # one parameter: one of the ranks owns nothing
    where = "ShardedOptimizer([one parameter], SGD, lr=0.1)"
    optimizer = call(where, cls, [lone], torch.optim.SGD, lr=0.1)
    lone.grad = torch.full((3,), 2.0)
    hint = "a rank that owns no parameter has no optimizer of its own (self.optimizer is None): "
    hint += "it only takes part in the broadcasts."
    call(f"{where}.step", optimizer.step, hint=hint)
    results["lone"] = lone.detach().clone()
    return results


def check_sharded_optimizer(cls: type) -> None:
    """On two gloo ranks, the same gradients: after 3 steps (two parameter groups, a schedule
    that halves the lr and the weight decay) the weights of the unsharded optimizer (1e-6), AdamW
    and SGD, each rank's optimizer state only for the parameters it owns; and a rank that owns
    no parameter."""
    results = on_two_ranks("ShardedOptimizer", _sharded_worker, cls)
    for label, (optimizer_cls, kwargs) in OPTIMIZERS.items():
        model = _toy()
        expected = _optimize(model, optimizer_cls(_groups(model), **kwargs))
        mistakes = {}
        for schedule, hint in (
            (
                (),
                "this rank's optimizer kept the settings it started with: copy each group's "
                "settings (a schedule changes group['lr'] and group['weight_decay']) into its own "
                "groups before stepping.",
            ),
            (
                ("lr",),
                "only the learning rate reached this rank's optimizer: copy every setting "
                "of each group but 'params' (a schedule may change group['weight_decay'] too).",
            ),
        ):
            model = _toy()
            mistakes[hint] = _optimize(model, optimizer_cls(_groups(model), **kwargs), schedule)
        for key, value in results[0][label].items():
            same = torch.equal(value, results[1][label][key])
            hint = "after the step, broadcast each parameter from its owner "
            hint += "(dist.broadcast(p, src=self.owner[p])): every rank then holds every update."
            expect(same, f"ShardedOptimizer with {label}", f"the ranks' `{key}` differ.", hint)
        for rank in (0, 1):
            where = f"ShardedOptimizer with {label}, rank {rank}"
            expect_states(where, results[rank][label], expected, mistakes, atol=1e-6)
            others = results[rank][f"{label} state"]
            problem = f"it keeps optimizer state for {others}, which rank {1 - rank} owns."
            hint = "step self.optimizer, this rank's optimizer over the parameters it owns: "
            hint += "each rank keeps the state of its own share only (that is the saving)."
            expect(not others, where, problem, hint)
    for rank in (0, 1):
        where = f"ShardedOptimizer over one parameter, rank {rank}"
        hint = "broadcast each parameter from its owner after the step."
        expect_close(results[rank]["lone"], torch.full((3,), 0.8), where, hint, atol=1e-6)
    passed("ShardedOptimizer")


def _fsdp_worker(rank: int, cls: type) -> dict:
    results = {}
    for dtype in (None, torch.float16):
        where = f"FullyShardedDataParallel(GPT2, compute_dtype={dtype})"
        torch.manual_seed(rank)
        model = GPT2(DIST_CFG)
        numels = {n: p.numel() for n, p in model.named_parameters()}
        fsdp = call(where, cls, model, compute_dtype=dtype)
        shards = {n: p.numel() for n, p in fsdp.named_parameters()}
        for name, numel in numels.items():  # before any collective meets a slice too short
            kept = shards.get(f"module.{name}", numel)
            problem = f"`{name}` ({numel} elements) is kept as {kept} elements per rank: the "
            problem += f"last {numel - 2 * kept} are on no rank."
            hint = "pad the flat parameter with zeros to a multiple of the world size and keep "
            hint += "ceil(numel / world_size) elements per rank: numel // world_size loses the "
            hint += "remainder."
            expect(2 * kept >= numel, where, problem, hint)
        stored = {
            n: p.untyped_storage().nbytes() // p.element_size() for n, p in fsdp.named_parameters()
        }
        finish = finisher_of(where, fsdp)
        optimizer = torch.optim.SGD(fsdp.parameters(), lr=LR)
        with CollectiveBytes() as sent:
            train(fsdp, rank, finish, optimizer=optimizer)
        state = call(f"{where}.gather_full_params", fsdp.gather_full_params)
        gathered = sent.bytes.get("all_gather", 0)
        results[dtype] = dict(
            state=state, numels=numels, shards=shards, stored=stored, gathered=gathered
        )
    return results


def check_fsdp(cls: type) -> None:
    """On two gloo ranks: each keeps half of every parameter (padded: the remainder kept);
    after 3 SGD steps on each rank's half of the batch, the gathered weights of one process
    trained on the whole batch: 1e-5 computing in float32, 2e-3 in float16."""
    results = on_two_ranks("FullyShardedDataParallel", _fsdp_worker, cls)
    expected = train(initial_model(), None, None)
    mistakes = {
        "the gradients were summed, not averaged: divide by the world size before the "
        "reduce-scatter.": train(initial_model(), None, None, lr=2 * LR),
    }
    for dtype, atol in ((None, 1e-5), (torch.float16, 2e-3)):
        where = f"FullyShardedDataParallel(compute_dtype={dtype})"
        got = results[0][dtype]
        for name, numel in got["numels"].items():
            shard = got["shards"].get(f"module.{name}")
            want = math.ceil(numel / 2)
            problem = f"`{name}` ({numel} elements) is kept as {shard} elements on rank 0."
            hint = "each rank keeps ceil(numel / world_size) elements: the flat parameter, "
            hint += "padded with zeros to a multiple of the world size, cut in equal slices."
            expect(shard is None or shard == want, where, problem, hint)
            stored = got["stored"].get(f"module.{name}", want)
            problem = f"`{name}`'s slice of {want} elements keeps {stored} in memory."
            hint = "clone this rank's slice: a slice of the padded tensor keeps all of it alive."
            expect(stored == want, where, problem, hint)
        wrong = {k: str(t.dtype) for k, t in got["state"].items() if t.dtype != torch.float32}
        problem = f"gather_full_params() gave {wrong}, not float32."
        hint = "_all_gather(shard, dtype) gathers in `dtype` when one is given (the compute dtype "
        hint += "only by default): the full parameters are the float32 masters."
        expect(not wrong, where, problem, hint)
        expect_states(where, got["state"], expected, mistakes, atol=atol)
    half, full = results[0][torch.float16]["gathered"], results[0][None]["gathered"]
    problem = f"computing in float16 it gathered {half:,} bytes, against {full:,} in float32."
    hint = "cast this rank's slice to the compute dtype before all_gather_single: a float16 "
    hint += "step then moves half the bytes of a float32 one."
    expect(
        half <= 0.6 * full, "FullyShardedDataParallel(compute_dtype=torch.float16)", problem, hint
    )
    passed("FullyShardedDataParallel")
