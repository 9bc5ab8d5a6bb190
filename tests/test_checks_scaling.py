"""The chapter 8 checkers, imported from `checks.scaling` as the workbook does: the reference
passes, valid alternatives pass, a blank fails with its hint, and each classic mistake is named
(each written out here as a small variant of the reference, as a learner would write it). The
distributed checkers fork two gloo ranks; FlashAttention's mistakes are in
test_checks_flash_attention.py."""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from checking import fails
from torch import nn

from transformer_course import data_parallel, flash_attention, sharded, step_cost
from transformer_course.checks import scaling
from transformer_course.checks.scaling import (
    check_data_parallel,
    check_flash_attention_backward,
    check_flash_attention_forward,
    check_flash_attention_function,
    check_flops_per_token,
    check_fsdp,
    check_make_buckets,
    check_param_count,
    check_sharded_optimizer,
)
from transformer_course.gpt2 import GPT2, GPT2Config
from transformer_course.llama import Llama
from transformer_course.parts import parts_of

CHECKS = {  # checker: (the reference, its name in the ✓ line)
    check_param_count: (step_cost.param_count, "param_count"),
    check_flops_per_token: (step_cost.flops_per_token, "flops_per_token"),
    check_flash_attention_forward: (
        flash_attention.flash_attention_forward,
        "flash_attention_forward",
    ),
    check_flash_attention_backward: (
        flash_attention.flash_attention_backward,
        "flash_attention_backward",
    ),
    check_flash_attention_function: (flash_attention.FlashAttention, "FlashAttention"),
    check_make_buckets: (data_parallel.make_buckets, "make_buckets"),
    check_data_parallel: (data_parallel.DataParallel, "DataParallel"),
    check_sharded_optimizer: (sharded.ShardedOptimizer, "ShardedOptimizer"),
    check_fsdp: (sharded.FullyShardedDataParallel, "FullyShardedDataParallel"),
}
needs_dist = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_reference_passes(check, capsys):
    reference, name = CHECKS[check]
    check(reference)
    assert f"✓ {name}" in capsys.readouterr().out


def blank(*args, **kwargs):
    raise NotImplementedError("Exercise 8.x: write it (hints below the cell)")


@pytest.mark.parametrize("check", list(CHECKS)[:6], ids=lambda check: check.__name__)
def test_a_blank_is_reported_as_not_implemented(check):
    candidate = blank
    if check is check_flash_attention_function:
        candidate = type("Blank", (torch.autograd.Function,), {"forward": staticmethod(blank)})
    fails(check, candidate, "not implemented yet")


def test_scaling_gives_every_chapter_8_checker():
    """`checks.scaling` re-exports the checkers of the modules chapter 8's are split into."""
    for name in ("flash_attention", "data_parallel", "sharded"):
        module = importlib.import_module(f"transformer_course.checks.{name}")
        own = [n for n in vars(module) if n.startswith("check_")]
        assert own, f"checks.{name} has no checker"
        for checker in own:
            assert checker in scaling.__all__, f"checks.scaling does not export {checker}"
            assert getattr(scaling, checker) is getattr(module, checker)
    assert len(scaling.__all__) == len(CHECKS)


def test_each_part_of_chapter_8_is_checked_by_its_checker():
    """The parts' `Course:` lines (some wrap before the checker) name these nine checkers."""
    parts = parts_of(8)
    assert [part.number for part in parts] == [f"8.{n}" for n in range(1, 10)]
    assert {part.name: part.check for part in parts} == {
        name: check for check, (_, name) in CHECKS.items()
    }


# ---- what a step costs ----------------------------------------------------------------------


def test_param_count_by_building_the_model_passes():
    check_param_count(
        lambda cfg: sum(
            p.numel()
            for p in (GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)).parameters()
        )
    )


def test_param_count_mistakes_are_named():
    def tied_twice(cfg):
        return step_cost.param_count(cfg) + (cfg.d_vocab * cfg.d_model if cfg.tie_embeddings else 0)

    fails(check_param_count, tied_twice, "tied", "once")

    def no_position_table(cfg):
        gpt2 = isinstance(cfg, GPT2Config)
        return step_cost.param_count(cfg) - (cfg.n_ctx * cfg.d_model if gpt2 else 0)

    fails(check_param_count, no_position_table, "W_pos")

    def kv_with_every_head(cfg):
        extra = 0 if isinstance(cfg, GPT2Config) else cfg.n_heads - cfg.n_kv_heads
        return step_cost.param_count(cfg) + 2 * cfg.n_layers * extra * cfg.d_model * cfg.d_head

    fails(check_param_count, kv_with_every_head, "n_kv_heads")
    fails(check_param_count, lambda cfg: float(step_cost.param_count(cfg)), "expected an int")


def test_flops_mistakes_are_named():
    def forward_only(cfg, seq_len):
        n = step_cost.flop_param_count(cfg)
        return 2 * n + 4 * cfg.n_layers * cfg.n_heads * cfg.d_head * seq_len

    fails(check_flops_per_token, forward_only, "backward costs twice")
    fails(check_flops_per_token, lambda cfg, t: 6 * step_cost.flop_param_count(cfg), "12 L H Q T")

    def with_embeddings(cfg, seq_len):
        heads = cfg.n_layers * cfg.n_heads * cfg.d_head
        return 6 * step_cost.param_count(cfg) + 12 * heads * seq_len

    fails(check_flops_per_token, with_embeddings, "flop_param_count")


# ---- buckets ---------------------------------------------------------------------------------


def test_make_buckets_alternative_passes():
    def by_bytes(params, bucket_size_mb):
        if bucket_size_mb is None:
            return [[p] for p in params]
        buckets, left = [], -1.0
        for p in params:
            size = p.nbytes / 2**20
            if buckets and size <= left and buckets[-1][-1].dtype == p.dtype:
                buckets[-1].append(p)
                left -= size
            else:
                buckets.append([p])
                left = bucket_size_mb - size
        return buckets

    check_make_buckets(by_bytes)


def test_make_buckets_mistakes_are_named():
    def variant(mib=2**20, element=lambda p: p.element_size(), by_dtype=True):
        def make_buckets(params, bucket_size_mb):
            if bucket_size_mb is None:
                return [[p] for p in params]
            buckets, used = [], 0
            for p in params:
                nbytes = p.numel() * element(p)
                new_dtype = by_dtype and buckets and buckets[-1][0].dtype != p.dtype
                if not buckets or used + nbytes > bucket_size_mb * mib or new_dtype:
                    buckets.append([])
                    used = 0
                buckets[-1].append(p)
                used += nbytes
            return buckets

        return make_buckets

    fails(check_make_buckets, variant(mib=10**6), "2**20")
    fails(check_make_buckets, variant(element=lambda p: 1), "element_size")
    fails(check_make_buckets, variant(element=lambda p: 4), "float64 element takes 8 bytes")
    fails(check_make_buckets, variant(by_dtype=False), "dtype")

    def strict(params, bucket_size_mb):  # a bucket exactly full starts a new one
        if bucket_size_mb is None:
            return [[p] for p in params]
        buckets, used = [], 0
        for p in params:
            new_dtype = buckets and buckets[-1][0].dtype != p.dtype
            if not buckets or used + p.nbytes >= bucket_size_mb * 2**20 or new_dtype:
                buckets.append([])
                used = 0
            buckets[-1].append(p)
            used += p.nbytes
        return buckets

    fails(check_make_buckets, strict, "exactly fills")
    fails(check_make_buckets, lambda params, size: [params], "expected buckets")


# ---- two ranks -------------------------------------------------------------------------------


class Summed(data_parallel.DataParallel):
    """Sums the gradients without dividing by the world size."""

    def _start(self, bucket):
        super()._start(bucket)
        bucket.work.wait()
        bucket.flat[: -len(bucket.params)].mul_(self.world_size)


class NotWrittenBack(data_parallel.DataParallel):
    """Waits for the all-reduces but never copies the averages into the gradients."""

    def finish_gradient_synchronization(self):
        for bucket in self._buckets[self._next :]:
            self._start(bucket)
        for bucket in self._buckets:
            bucket.work.wait()
            bucket.ready, bucket.flat, bucket.work = 0, None, None
        self._has_grad.clear()
        self._next = 0


class ZeroForUnused(data_parallel.DataParallel):
    """Gives every parameter a gradient, zeros where no rank used it."""

    def finish_gradient_synchronization(self):
        super().finish_gradient_synchronization()
        for bucket in self._buckets:
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)


class Blocking(data_parallel.DataParallel):
    """All-reduces each bucket in `_start` with a blocking call: nothing overlaps."""

    def _start(self, bucket):
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flags = torch.tensor([float(p.grad is not None) for p in bucket.params])
        bucket.flat = torch.cat([*(g.flatten() / self.world_size for g in grads), flags])
        dist.all_reduce(bucket.flat)
        bucket.work = SimpleNamespace(wait=lambda: None)


class WaitsInStart(data_parallel.DataParallel):
    """Starts each all-reduce asynchronously, then waits for it at once."""

    def _start(self, bucket):
        super()._start(bucket)
        bucket.work.wait()


@needs_dist
def test_data_parallel_mistakes_are_named():
    fails(check_data_parallel, Summed, "divide by the world size")
    fails(check_data_parallel, NotWrittenBack, "write the averaged gradient back")
    fails(check_data_parallel, ZeroForUnused, "grad None")
    fails(check_data_parallel, Blocking, "blocked until done", "async_op=True")
    fails(check_data_parallel, WaitsInStart, "waited on during the backward")


class NoBroadcast(sharded.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        for group, j in zip(self.param_groups, self._local_group):
            if j is not None:
                local = self.optimizer.param_groups[j]
                local.update({k: v for k, v in group.items() if k != "params"})
        if self.optimizer is not None:
            self.optimizer.step()


class StaleLearningRate(sharded.ShardedOptimizer):
    @torch.no_grad()
    def step(self, closure=None):
        if self.optimizer is not None:
            self.optimizer.step()
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p, src=self.owner[p])


class Hangs(sharded.ShardedOptimizer):
    """Rank 1 skips the broadcasts, so rank 0 waits for them forever."""

    @torch.no_grad()
    def step(self, closure=None):
        if self.rank == 0:
            super().step()
        elif self.optimizer is not None:
            self.optimizer.step()


class StepsEveryParameter(sharded.ShardedOptimizer):
    """Its optimizer steps every parameter on every rank (the broadcasts hide it)."""

    def __init__(self, params, optimizer_cls, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        self.optimizer = optimizer_cls([dict(g) for g in self.param_groups], **kwargs)
        self._local_group = list(range(len(self.param_groups)))


@needs_dist
def test_sharded_optimizer_mistakes_are_named(monkeypatch):
    fails(check_sharded_optimizer, NoBroadcast, "broadcast each parameter from its owner")
    fails(check_sharded_optimizer, StaleLearningRate, "copy each group's settings")
    fails(check_sharded_optimizer, StepsEveryParameter, "keeps optimizer state", "own share")
    monkeypatch.setattr("transformer_course.checks.data_parallel.RANKS_TIMEOUT", 10)
    fails(check_sharded_optimizer, Hangs, "same collectives")


class SummedShards(sharded.FullyShardedDataParallel):
    def _reduce_scatter(self, shard, grad_full):
        super()._reduce_scatter(shard, grad_full * self.world_size)


class WholeCopies(sharded.FullyShardedDataParallel):
    """Keeps every parameter whole on every rank (and so trains right)."""

    def _make_shard(self, p):
        shard = nn.Parameter(p.detach().float().flatten().clone(), requires_grad=p.requires_grad)
        self._shards[shard] = sharded._Shard(p.shape, p.numel(), p.numel())
        return shard

    def _all_gather(self, shard, dtype=None):
        info = self._shards[shard]
        return shard.detach().to(dtype or self.compute_dtype).view(info.shape)

    def _reduce_scatter(self, shard, grad_full):
        out = grad_full.flatten().float() / self.world_size
        self._pending.append((shard, out, dist.all_reduce(out, async_op=True)))


class NoPadding(sharded.FullyShardedDataParallel):
    """Cuts numel // world_size elements per rank, without padding."""

    def _make_shard(self, p):
        shard_numel = p.numel() // self.world_size
        mine = p.detach().float().flatten()[self.rank * shard_numel :][:shard_numel].clone()
        shard = nn.Parameter(mine, requires_grad=p.requires_grad)
        self._shards[shard] = sharded._Shard(p.shape, p.numel(), shard_numel)
        return shard


@needs_dist
def test_fsdp_mistakes_are_named():
    fails(check_fsdp, SummedShards, "divide by the world size")
    fails(check_fsdp, WholeCopies, "ceil(numel / world_size)")
    fails(check_fsdp, NoPadding, "on no rank", "remainder")


class SliceKeepsTheWhole(sharded.FullyShardedDataParallel):
    """Keeps a view of the padded tensor as its slice (no clone)."""

    def _make_shard(self, p):
        shard_numel = math.ceil(p.numel() / self.world_size)
        flat = torch.zeros(shard_numel * self.world_size, device=p.device)
        flat[: p.numel()] = p.detach().flatten()
        mine = flat[self.rank * shard_numel : (self.rank + 1) * shard_numel]
        shard = nn.Parameter(mine, requires_grad=p.requires_grad)
        self._shards[shard] = sharded._Shard(p.shape, p.numel(), shard_numel)
        return shard


class GathersInTheComputeDtype(sharded.FullyShardedDataParallel):
    def _all_gather(self, shard, dtype=None):
        return super()._all_gather(shard)


class GathersInFloat32(sharded.FullyShardedDataParallel):
    """Gathers the float32 slices, then casts the whole to the compute dtype."""

    def _all_gather(self, shard, dtype=None):
        return super()._all_gather(shard, torch.float32).to(dtype or self.compute_dtype)


@needs_dist
def test_fsdp_slices_and_full_parameters_are_checked():
    fails(check_fsdp, SliceKeepsTheWhole, "clone this rank's slice")
    fails(check_fsdp, GathersInTheComputeDtype, "not float32", "float32 masters")
    fails(check_fsdp, GathersInFloat32, "moves half the bytes")


class OnlyTheLearningRate(sharded.ShardedOptimizer):
    """Copies group["lr"] to this rank's groups, not the other settings."""

    @torch.no_grad()
    def step(self, closure=None):
        for group, j in zip(self.param_groups, self._local_group):
            if j is not None:
                self.optimizer.param_groups[j]["lr"] = group["lr"]
        if self.optimizer is not None:
            self.optimizer.step()
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p, src=self.owner[p])


class AlwaysSteps(sharded.ShardedOptimizer):
    """Steps its own optimizer without asking whether this rank owns anything."""

    @torch.no_grad()
    def step(self, closure=None):
        self.optimizer.step()
        for group in self.param_groups:
            for p in group["params"]:
                dist.broadcast(p, src=self.owner[p])


@needs_dist
def test_sharded_optimizer_settings_and_ownerless_ranks_are_checked():
    fails(check_sharded_optimizer, OnlyTheLearningRate, "only the learning rate")
    fails(check_sharded_optimizer, AlwaysSteps, "owns no parameter")


class NeverReset(data_parallel.DataParallel):
    """Averages right, but leaves the step's state for the next step."""

    def finish_gradient_synchronization(self):
        has_grad = set(self._has_grad)
        super().finish_gradient_synchronization()
        self._has_grad = has_grad


@needs_dist
def test_a_data_parallel_that_never_resets_is_told_so():
    fails(check_data_parallel, NeverReset, "reset each bucket's ready")
