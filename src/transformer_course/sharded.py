"""Sharding the training state across ranks, in two steps (Rajbhandari et al., 2020, ZeRO).

Data parallelism (`data_parallel`) keeps on every rank a whole copy of the parameters, the
gradients and the optimizer's state: 16 bytes per parameter with float32 AdamW, whatever the
number of ranks. Sharding gives each rank a slice instead.

- `ShardedOptimizer` (ZeRO stage 1) shards the optimizer's state, the largest share (AdamW's two
  running means: 8 of the 16 bytes). Each parameter belongs to one rank, which keeps its
  optimizer state and updates it; after each step every rank broadcasts the parameters it
  owns, so all ranks again hold the same, whole model.
- `FullyShardedDataParallel` (ZeRO stage 3, PyTorch's FSDP) shards everything: each rank keeps
  a 1/world_size slice of every parameter, of its gradient and (with an optimizer over the
  slices) of its optimizer state. A layer's whole parameters exist only while it computes:
  all-gathered just before its forward and freed just after, gathered again in the backward,
  and their gradients are summed and sliced across ranks by a reduce-scatter. Parameters too
  small to be worth a collective each (a norm's weight, a bias) can stay whole on every rank
  (`replicate_below`, like DeepSpeed's `stage3_param_persistence_threshold`): their gradients
  are all-reduced, as under data parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.data_parallel import check_same_parameters, require_process_group

__all__ = ["ShardedOptimizer", "FullyShardedDataParallel"]


def all_gather_single(output: Tensor, input: Tensor, **kwargs: Any) -> Any:
    """Every rank's `input` side by side in `output` (world_size times its size): PyTorch's
    collective on one flat tensor, under its 2.13 name or the earlier one."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, **kwargs)


def reduce_scatter_single(output: Tensor, input: Tensor, **kwargs: Any) -> Any:
    """The sum over ranks of `input`, cut in world_size equal slices: this rank's in `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, **kwargs)


class ShardedOptimizer(torch.optim.Optimizer):
    """Any optimizer with its state sharded across the ranks (ZeRO-1):
    `ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`.

    Each parameter is owned by one rank: parameters go, largest first, to the rank that owns the
    fewest elements so far, so each rank's share of the state is close to 1/world_size. Each
    rank runs `optimizer_cls(its parameters, **kwargs)`; `step()` updates those and then every
    rank broadcasts the parameters it owns. Use it after the gradients are averaged
    (`DataParallel.finish_gradient_synchronization()`): every rank then takes the step an
    unsharded optimizer would. `param_groups` holds every parameter (a learning-rate schedule
    sets `group["lr"]` there, as usual); `optimizer` is this rank's own, and `state_dict()` is
    this rank's shard of the state.

    Course: chapter 8, exercise 8.8, checked by checks.sharded.check_sharded_optimizer.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        optimizer_cls: type[torch.optim.Optimizer],
        **kwargs: Any,
    ) -> None:
        self.rank, self.world_size = require_process_group()
        if not (
            isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
        ):
            got = repr(optimizer_cls)
            if isinstance(optimizer_cls, torch.optim.Optimizer):
                got = f"an instance of {type(optimizer_cls).__name__}"
            raise TypeError(
                "optimizer_cls: expected a torch.optim.Optimizer class (such as "
                f"torch.optim.AdamW, not an instance), got {got}"
            )
        self.optimizer_cls, self.kwargs = optimizer_cls, kwargs
        self.optimizer: torch.optim.Optimizer | None = None  # this rank's, over its parameters
        self.owner: dict[Tensor, int] = {}  # parameter -> the rank that updates it
        self._owned = [0] * self.world_size  # elements owned by each rank
        self._local_group: list[int | None] = []  # param_groups[i] -> optimizer.param_groups[j]
        super().__init__(params, kwargs)  # calls add_param_group for each group
        self._check_same_shapes()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as any optimizer can): its parameters are shared out among the ranks,
        and this rank's optimizer gets the ones it owns."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in sorted(group["params"], key=lambda p: -p.numel()):  # sorted() is stable
            owner = min(range(self.world_size), key=lambda r: self._owned[r])
            self.owner[p] = owner
            self._owned[owner] += p.numel()
        mine = [p for p in group["params"] if self.owner[p] == self.rank]
        if not mine:
            self._local_group.append(None)
            return
        local = {**{k: v for k, v in group.items() if k != "params"}, "params": mine}
        if self.optimizer is None:
            self.optimizer = self.optimizer_cls([local], **self.kwargs)
        else:
            self.optimizer.add_param_group(local)
        self._local_group.append(len(self.optimizer.param_groups) - 1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Update this rank's parameters, then broadcast every parameter from its owner."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.optimizer is not None:
            for group, j in zip(self.param_groups, self._local_group):
                if j is not None:  # settings changed here (a schedule's lr) reach the shard
                    local = self.optimizer.param_groups[j]
                    local.update({k: v for k, v in group.items() if k != "params"})
            self.optimizer.step()
        works = [
            dist.broadcast(p, src=self.owner[p], async_op=True)
            for group in self.param_groups
            for p in group["params"]
        ]
        for work in works:
            work.wait()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (save one per rank)."""
        if self.optimizer is None:
            return {"state": {}, "param_groups": []}
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict()` returned on this rank, with the same world size."""
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state_dict)

    def _check_same_shapes(self) -> None:
        """Every rank passed parameters of the same shapes in the same order (ownership is
        computed from them); a clear error on every rank otherwise."""
        mine = [tuple(p.shape) for group in self.param_groups for p in group["params"]]
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                index = next(
                    (i for i, (a, b) in enumerate(zip(everyone[0], theirs)) if a != b),
                    min(len(theirs), len(everyone[0])),
                )
                a, b = (s[index] if index < len(s) else "missing" for s in (everyone[0], theirs))
                raise ValueError(
                    f"params: expected the same parameters on every rank; params[{index}] has "
                    f"shape {a} on rank 0 but {b} on rank {rank}"
                )


@dataclass
class _Shard:
    """What a rank knows of one parameter: the shape of the whole and how it is cut. The whole,
    flattened and padded with zeros to `world_size * shard_numel` elements, is cut into
    `world_size` equal slices; rank r keeps slice r. A `replicated` parameter is not cut: every
    rank keeps the whole."""

    shape: torch.Size
    numel: int
    shard_numel: int
    replicated: bool = False


class _Use:
    """One use of a parameter in one forward: the slice it was gathered from, and (during the
    backward) the whole gathered again, kept until the parameter's gradient has been sent."""

    def __init__(self, fsdp: FullyShardedDataParallel, shard: nn.Parameter) -> None:
        self.fsdp, self.shard, self.full = fsdp, shard, None


class _GatherParameter(torch.autograd.Function):
    """Forward: the whole parameter, all-gathered from the slices, in the compute dtype.
    Backward: its gradient, reduce-scattered into the slices (asynchronously: the slices'
    `.grad` are set in `finish_gradient_synchronization`)."""

    @staticmethod
    def forward(ctx: Any, shard: nn.Parameter, use: _Use) -> Tensor:
        ctx.use = use
        return use.fsdp._whole(shard)

    @staticmethod
    def backward(ctx: Any, grad_full: Tensor) -> tuple[None, None]:
        use = ctx.use
        use.full = None  # gathered again for this backward, and no longer needed
        use.fsdp._send_gradient(use.shard, grad_full)
        return None, None


@dataclass
class _Regather:
    """What autograd keeps instead of a saved (view of a) gathered parameter: how to rebuild it."""

    use: _Use
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class FullyShardedDataParallel(nn.Module):
    """Fully sharded data parallelism (ZeRO-3) by hand, on an initialised process group.

    Rank 0's weights are broadcast, then each parameter is flattened, padded with zeros to a
    multiple of the world size and cut into equal slices: each rank keeps one, as a float32
    `nn.Parameter` registered in place of the parameter (same name, 1-d): `parameters()` are
    the slices, for the optimizer (whose state is then sharded too).

    The units are the modules that hold parameters themselves (an embedding, a norm, an
    attention, an MLP). A forward pre-hook all-gathers a unit's parameters, in `compute_dtype`
    (default float32), through an autograd function, and sets them on the module for its
    forward; a forward hook drops them after it. While the model runs, a
    `saved_tensors_hooks` pack hook replaces each tensor autograd would save that is (a view
    of) a gathered parameter by a note of how to rebuild it; its unpack hook gathers the
    parameter again when the backward needs it. So no whole parameter outlives its module's
    forward, and none is kept in the backward longer than its gradient takes. (An operation
    that saves its own copy of a weight keeps that copy: einsum saves permuted copies of
    GPT-2's W_Q, W_K and W_V, which live until the backward.) The gather's
    backward reduce-scatters the whole gradient, in float32 and divided by the world size,
    into the slices: each rank receives the average over ranks of its slice, and a parameter
    used twice (a tied embedding) gets both uses' gradients.

    Parameters with fewer than `replicate_below` elements (default 0: none) are not sharded:
    every rank keeps the whole, in float32, as its own `nn.Parameter` (same name and shape),
    cast to the compute dtype for each use without a collective; their gradients are
    all-reduced and averaged (asynchronously, like the slices') and so stay bitwise equal on
    every rank, as do the parameters after any optimizer's step.

    Every rank must run the same modules in the same order (they all gather together).
    A module may only use its own parameters in its forward. Buffers stay as they are.

        model = FullyShardedDataParallel(GPT2(cfg), compute_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # over the slices
        lm_loss(model(tokens), targets).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
        state = model.gather_full_params()   # every rank: the whole float32 state dict

    Course: chapter 8, exercise 8.9, checked by checks.sharded.check_fsdp.
    """

    def __init__(
        self, module: nn.Module, compute_dtype: torch.dtype | None = None, replicate_below: int = 0
    ) -> None:
        super().__init__()
        self.rank, self.world_size = require_process_group()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        self.replicate_below = validate.integer("replicate_below", replicate_below, low=0)
        compute_dtype = torch.float32 if compute_dtype is None else compute_dtype
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ValueError(
                f"compute_dtype: expected a floating dtype such as torch.bfloat16, "
                f"got {compute_dtype!r}"
            )
        self.compute_dtype = compute_dtype
        check_same_parameters(module)
        with torch.no_grad():
            for t in [*module.parameters(), *module.buffers()]:
                dist.broadcast(t, src=0)
        self.module = module
        self._shards: dict[nn.Parameter, _Shard] = {}
        shard_of: dict[nn.Parameter, nn.Parameter] = {}  # whole -> slice (a shared one once)
        for p in module.parameters():
            small = p.numel() < self.replicate_below
            shard_of[p] = self._make_replica(p) if small else self._make_shard(p)
        self._units: dict[nn.Module, list[tuple[str, nn.Parameter]]] = {}
        for unit in module.modules():
            own = [(n, p) for n, p in unit._parameters.items() if p is not None]
            if own:
                self._units[unit] = [(n, shard_of[p]) for n, p in own]
                for n, p in own:
                    unit._parameters[n] = shard_of[p]
                unit.register_forward_pre_hook(self._gather_unit)
                unit.register_forward_hook(self._free_unit)
        self._gathered: dict[int, _Use] = {}  # storage address -> the use it was gathered for
        self._pending: list[tuple[nn.Parameter, Tensor, Any]] = []  # reduce-scatters in flight

    def _make_replica(self, p: nn.Parameter) -> nn.Parameter:
        """The whole of `p` in float32, kept on every rank (a parameter under the threshold)."""
        whole = nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
        self._shards[whole] = _Shard(p.shape, p.numel(), p.numel(), replicated=True)
        return whole

    def _make_shard(self, p: nn.Parameter) -> nn.Parameter:
        """This rank's float32 slice of `p`, flattened and zero-padded to a multiple of the
        world size, as a new parameter."""
        shard_numel = math.ceil(p.numel() / self.world_size)
        flat = torch.zeros(shard_numel * self.world_size, dtype=torch.float32, device=p.device)
        flat[: p.numel()] = p.detach().flatten()
        mine = flat[self.rank * shard_numel : (self.rank + 1) * shard_numel].clone()
        shard = nn.Parameter(mine, requires_grad=p.requires_grad)
        self._shards[shard] = _Shard(p.shape, p.numel(), shard_numel)
        return shard

    def _all_gather(self, shard: nn.Parameter, dtype: torch.dtype | None = None) -> Tensor:
        """The whole parameter of `shard`, in `dtype` (default the compute dtype)."""
        info = self._shards[shard]
        dtype = dtype or self.compute_dtype
        flat = torch.empty(info.shard_numel * self.world_size, dtype=dtype, device=shard.device)
        all_gather_single(flat, shard.detach().to(dtype))
        return flat[: info.numel].view(info.shape)

    def _whole(self, shard: nn.Parameter, dtype: torch.dtype | None = None) -> Tensor:
        """The whole parameter of `shard` in `dtype` (default the compute dtype): gathered from
        the slices, or a replica's own copy, cast without a collective."""
        if self._shards[shard].replicated:
            return shard.detach().to(dtype or self.compute_dtype, copy=True)
        return self._all_gather(shard, dtype)

    def _send_gradient(self, shard: nn.Parameter, grad_full: Tensor) -> None:
        """Start averaging `grad_full` over ranks: reduce-scattered into this rank's slice, or
        all-reduced whole for a replica."""
        if self._shards[shard].replicated:
            average = grad_full.float() / self.world_size
            self._pending.append((shard, average, dist.all_reduce(average, async_op=True)))
        else:
            self._reduce_scatter(shard, grad_full)

    def _reduce_scatter(self, shard: nn.Parameter, grad_full: Tensor) -> None:
        """Start summing `grad_full / world_size` over ranks into this rank's slice."""
        info = self._shards[shard]
        flat = torch.zeros(info.shard_numel * self.world_size, device=shard.device)
        flat[: info.numel] = grad_full.flatten().float() / self.world_size
        out = torch.empty(info.shard_numel, device=shard.device)
        work = reduce_scatter_single(out, flat, async_op=True)
        self._pending.append((shard, out, work))

    def _gather_unit(self, unit: nn.Module, args: Any) -> None:
        """Forward pre-hook: the unit's whole parameters, set on it for its forward."""
        for name, shard in self._units[unit]:
            use = _Use(self, shard)
            full = _GatherParameter.apply(shard, use)
            self._gathered[full.untyped_storage().data_ptr()] = use
            unit.__dict__[name] = full  # found before the registered slice while it runs

    def _free_unit(self, unit: nn.Module, args: Any, output: Any) -> None:
        """Forward hook: drop the unit's whole parameters (autograd keeps only _Regather notes)."""
        for name, _ in self._units[unit]:
            full = unit.__dict__.pop(name)
            self._gathered.pop(full.untyped_storage().data_ptr(), None)

    def _pack(self, t: Tensor) -> Any:
        use = self._gathered.get(t.untyped_storage().data_ptr())
        if use is None:
            return t
        return _Regather(use, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Regather):
            return saved
        use = saved.use
        if use.full is None:
            use.full = self._whole(use.shard)
        return use.full.as_strided(saved.size, saved.stride, saved.offset)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._pending:
            raise RuntimeError(
                "FullyShardedDataParallel: the last backward's gradients are still being "
                "reduce-scattered; call finish_gradient_synchronization() after every "
                "backward(), before step()"
            )
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradients' reduce-scatters and add each into its slice's `.grad`.

        Course: chapter 8.
        """
        for shard, out, work in self._pending:
            work.wait()
            shard.grad = out if shard.grad is None else shard.grad + out
        self._pending.clear()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Scale every slice's gradient so that the whole model's gradient norm is at most
        `max_norm`; returns that norm (before scaling), the same on every rank. Each rank holds
        only its slices, so the squared norms are summed across ranks first (a replicated
        parameter's counted on rank 0 only)."""
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        squares = torch.zeros((), device=grads[0].device if grads else None)
        for p in self.parameters():
            if p.grad is not None and (self.rank == 0 or not self._shards[p].replicated):
                squares += p.grad.double().pow(2).sum().float()
        dist.all_reduce(squares)
        norm = squares.sqrt()
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)
        return norm

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, Tensor]:
        """The whole model's state dict, every parameter gathered in float32 (a tied one under
        each of its names), on every rank: `GPT2(cfg).load_state_dict(...)` takes it.

        Course: chapter 8.
        """
        gathered: dict[nn.Parameter, Tensor] = {}
        state = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            if t in self._shards:
                if t not in gathered:
                    gathered[t] = self._whole(t, torch.float32).clone()
                state[name] = gathered[t]
            else:
                state[name] = t.detach().clone()
        return state
