"""ZeRO-1 (`ShardedOptimizer`) and FSDP (`FullyShardedDataParallel`) on two gloo ranks on the CPU.

One fork of two ranks runs every distributed check (`results`); the tests read its results and
compare them with references computed here, in one process, or by PyTorch on the same ranks:

- `ShardedOptimizer` (AdamW: `torch.optim.AdamW` and the course's `optim.AdamW`) against the
  unsharded optimizer on the same gradients: each element goes through the same arithmetic,
  so we expect the same bits and allow `OPT_ATOL` = 1e-7. Under `DataParallel`, against
  `DataParallel` with the unsharded optimizer on the same ranks: the same, 1e-7;
- `FullyShardedDataParallel` computing in float32 (GPT-2 with tied embeddings, and the modern
  decoder) against single-process training on the whole batch, SGD with momentum (lr 0.5):
  equal up to float32 summation order, `ATOL` = 1e-6 after 3 steps (we see 1e-7; the weights
  move by 0.1 to 0.4). SGD, not AdamW: AdamW divides each gradient by its own running size,
  which turns the rounding noise of an exactly-zero gradient (the key biases') or of a tiny
  one into steps of about lr. Its first gradients (each rank's slice) against the slices of
  the whole batch's gradient computed here: `ATOL`;
- FSDP computing in float16 and in bfloat16 (both run on the CPU, matmuls included) against
  single-process mixed precision by hand (a half-precision copy of the float32 master weights
  does the forward and backward on the whole batch; its gradients, in float32, update the
  masters), the same SGD: `HALF_ATOL` 1e-3 for float16 and 1e-2 for bfloat16 (we see 1.4e-4
  and 1.4e-3: the two halves' gradients round differently from the whole batch's), where the
  weights move by ~0.4; that the compute ran in half precision is checked on the logits;
- FSDP keeping parameters under `REPLICATE_BELOW` elements whole (the norms and biases):
  against the same single-process training, `ATOL`; those parameters bitwise equal on both
  ranks; the bytes it hands to each collective in a step (`ranks.CollectiveBytes`) against
  `step_cost.collective_bytes_per_step(..., replicate_below=...)`;
- PyTorch's `torch.distributed.fsdp.fully_shard` (which runs on gloo) on the same ranks with
  the same SGD steps: `ATOL`.
"""

from __future__ import annotations

import copy
import math
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from transformer_course.data_parallel import DataParallel
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss
from transformer_course.llama import Llama, LlamaConfig
from transformer_course.optim import AdamW
from transformer_course.ranks import CollectiveBytes, on_ranks
from transformer_course.sharded import FullyShardedDataParallel, ShardedOptimizer
from transformer_course.step_cost import collective_bytes_per_step

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")

# d_vocab 65 and the Llama's 3 KV heads of 6 make odd-sized parameters, which FSDP pads.
CFG = GPT2Config(d_model=32, n_layers=2, n_heads=2, d_vocab=65, n_ctx=16, tie_embeddings=True)
LLAMA = LlamaConfig(d_model=36, n_layers=2, n_heads=6, n_kv_heads=3, d_vocab=65, n_ctx=16)
STEPS, BATCH, SEQ = 3, 8, 12
LR = 1e-2  # AdamW's
SGD_LR = 0.5
OPT_ATOL = 1e-7
ATOL = 1e-6
# We see 1.4e-4 and 1.4e-3: as far as the reference is itself from float32 training (2e-4, 2e-3).
REPLICATE_BELOW = 100  # CFG's norms and biases (32 to 65 elements); W_pos (512) is sharded
HALF_ATOL = {torch.float16: 1e-3, torch.bfloat16: 1e-2}
OPTIMIZERS = {"torch": torch.optim.AdamW, "course": AdamW}


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)


def batches(d_vocab: int = CFG.d_vocab) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, d_vocab, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def half_of(rank: int | None, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if rank is None:
        return tensors
    return tuple(t[rank * BATCH // 2 : (rank + 1) * BATCH // 2] for t in tensors)


def initial_model(cfg=CFG) -> nn.Module:
    torch.manual_seed(0)
    return GPT2(cfg) if isinstance(cfg, GPT2Config) else Llama(cfg)


def groups(model: nn.Module, lr: float = LR) -> list[dict]:
    """nanoGPT's two groups: weight decay for matrices, none for vectors."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def run_optimizer(model: nn.Module, optimizer, rank: int | None = None, finish=None) -> None:
    """The steps every optimizer test takes; the learning rate of the first group halves before
    the last step (a schedule: set in `param_groups`, as usual)."""
    for step, (tokens, targets) in enumerate(batches()):
        if step == STEPS - 1:
            optimizer.param_groups[0]["lr"] = LR / 2
        tokens, targets = half_of(rank, tokens, targets)
        loss = lm_loss(model(tokens), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def mixed_precision_reference(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Float32 master weights; each step a `dtype` copy does the forward and the backward on
    the whole batch, and its gradients, in float32, update the masters (SGD)."""
    master = initial_model()
    optimizer = sgd(master.parameters())
    for tokens, targets in batches():
        work = copy.deepcopy(master).to(dtype)
        lm_loss(work(tokens), targets).backward()
        for p, q in zip(master.parameters(), work.parameters()):
            p.grad = q.grad.float()
        optimizer.step()
    return state_of(master)


# What the two ranks run.


def zero1_checks(rank: int) -> dict:
    out: dict = {}
    # The same gradients on both ranks (each computes the whole batch's): only the optimizer
    # differs from the unsharded one.
    for name, cls in OPTIMIZERS.items():
        model = initial_model()
        optimizer = ShardedOptimizer(groups(model), cls, lr=LR, weight_decay=0.1)
        run_optimizer(model, optimizer)
        out[f"zero1_{name}"] = state_of(model)
        out[f"zero1_{name}_state_bytes"] = state_bytes(optimizer.optimizer)
        mine = {id(p) for g in optimizer.optimizer.param_groups for p in g["params"]}
        names = {id(p): n for n, p in model.named_parameters()}
        out[f"zero1_{name}_owned"] = sorted(names[i] for i in mine)
        out[f"zero1_{name}_with_state"] = sorted(names[id(p)] for p in optimizer.optimizer.state)
    # With DataParallel, the whole recipe: against DataParallel with the unsharded AdamW.
    for name, sharded in (("sharded", True), ("unsharded", False)):
        torch.manual_seed(rank)
        model = DataParallel(GPT2(CFG))
        if sharded:
            optimizer = ShardedOptimizer(groups(model), torch.optim.AdamW, lr=LR, weight_decay=0.1)
        else:
            optimizer = torch.optim.AdamW(groups(model), lr=LR, weight_decay=0.1)
        run_optimizer(model, optimizer, rank, model.finish_gradient_synchronization)
        out[f"data_parallel_{name}"] = state_of(model)
    try:
        ShardedOptimizer(GPT2(CFG).parameters(), torch.optim.AdamW(GPT2(CFG).parameters()))
    except TypeError as error:
        out["not_a_class"] = str(error)
    try:
        ShardedOptimizer([torch.zeros(3 + rank, requires_grad=True)], torch.optim.SGD, lr=0.1)
    except ValueError as error:
        out["zero1_differ"] = str(error)
    return out


def fsdp_train(rank, model, dtype=None, first_grads=None, replicate_below=0, sent=None):
    """SGD steps of `FullyShardedDataParallel(model)`; `first_grads` gets the first step's
    gradient slices, by parameter name, and `sent` the bytes of the last step's collectives."""
    model = FullyShardedDataParallel(model, compute_dtype=dtype, replicate_below=replicate_below)
    optimizer = sgd(model.parameters())
    for tokens, targets in batches(model.module.cfg.d_vocab):
        tokens, targets = half_of(rank, tokens, targets)
        with CollectiveBytes() as counted:
            logits = model(tokens)
            optimizer.zero_grad(set_to_none=True)
            lm_loss(logits, targets).backward()
            model.finish_gradient_synchronization()
        if sent is not None:
            sent.update(counted.bytes)
        if first_grads is not None and not first_grads:
            names = {id(p): n for n, p in model.module.named_parameters()}
            first_grads.update({names[id(p)]: p.grad.clone() for p in model.parameters()})
        optimizer.step()
    return model, logits.dtype


def fsdp_checks(rank: int) -> dict:
    out: dict = {}
    torch.manual_seed(rank)  # each rank's own weights: the broadcast must replace them
    first_grads: dict = {}
    model, _ = fsdp_train(rank, GPT2(CFG), first_grads=first_grads)
    out["fsdp"] = model.gather_full_params()
    out["fsdp_first_grads"] = first_grads
    out["fsdp_shards"] = {n: p.numel() for n, p in model.module.named_parameters()}
    torch.manual_seed(rank)
    sent: dict = {}
    model, _ = fsdp_train(rank, GPT2(CFG), replicate_below=REPLICATE_BELOW, sent=sent)
    out["replicated"] = model.gather_full_params()
    out["replicated_bytes"] = sent
    out["replicated_whole"] = {
        n: p.detach().clone()
        for n, p in model.module.named_parameters()
        if model._shards[p].replicated
    }
    torch.manual_seed(rank)
    model, _ = fsdp_train(rank, Llama(LLAMA))
    out["fsdp_llama"] = model.gather_full_params()
    for dtype in HALF_ATOL:
        torch.manual_seed(rank)
        model, logits_dtype = fsdp_train(rank, GPT2(CFG), dtype)
        out[f"fsdp_{dtype}"] = model.gather_full_params()
        out[f"fsdp_{dtype}_logits"] = logits_dtype
    out.update(fsdp_memory(rank))

    from torch.distributed.fsdp import fully_shard

    model = initial_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = sgd(model.parameters())
    for tokens, targets in batches():
        tokens, targets = half_of(rank, tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(tokens), targets).backward()
        optimizer.step()
    out["fully_shard"] = {k: v.full_tensor() for k, v in model.state_dict().items()}

    try:
        FullyShardedDataParallel(GPT2(CFG), compute_dtype=torch.int32)
    except ValueError as error:
        out["fsdp_dtype"] = str(error)
    for bad in (-1, 1.5):
        try:
            FullyShardedDataParallel(GPT2(CFG), replicate_below=bad)
        except ValueError as error:
            out[f"fsdp_replicate_{bad}"] = str(error)
    try:
        FullyShardedDataParallel(
            GPT2(CFG if rank == 0 else GPT2Config(**{**vars(CFG), "n_ctx": 8}))
        )
    except ValueError as error:
        out["fsdp_differ"] = str(error)
    return out


def fsdp_memory(rank: int) -> dict:
    """When are whole parameters alive? Each gather's result is followed with a weak reference;
    hooks registered after FSDP's count the live ones inside and after each unit's forward."""
    model = FullyShardedDataParallel(initial_model())
    refs: list = []
    gather = model._all_gather

    def recording_gather(*args):
        full = gather(*args)
        refs.append(weakref.ref(full))
        return full

    model._all_gather = recording_gather
    alive = lambda: sum(r() is not None for r in refs)
    inside, after = [], []
    for unit in model._units:
        own = len(model._units[unit])
        unit.register_forward_pre_hook(lambda m, a, own=own: inside.append((alive(), own)))
        unit.register_forward_hook(lambda m, a, o: after.append(alive()))
    tokens, targets = batches()[0]
    loss = lm_loss(model(tokens), targets)
    out = {"inside": inside, "after": after, "forward_gathers": len(refs)}
    out["alive_after_forward"] = alive()
    loss.backward()
    model.finish_gradient_synchronization()
    out["backward_gathers"] = len(refs) - out["forward_gathers"]
    out["alive_after_backward"] = alive()
    return out


def worker(rank: int) -> dict:
    return {**zero1_checks(rank), **fsdp_checks(rank)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return on_ranks(worker)


def single_process(cfg=CFG) -> dict[str, torch.Tensor]:
    model = initial_model(cfg)
    optimizer = sgd(model.parameters())
    for tokens, targets in batches(cfg.d_vocab):
        optimizer.zero_grad(set_to_none=True)
        lm_loss(model(tokens), targets).backward()
        optimizer.step()
    return state_of(model)


def assert_states_close(actual: dict, expected: dict, atol: float) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, atol=atol, rtol=0, msg=key)


# ZeRO-1.


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sharded_optimizer_equals_the_unsharded_one(results, name):
    model = initial_model()
    run_optimizer(model, OPTIMIZERS[name](groups(model), lr=LR, weight_decay=0.1))
    expected = state_of(model)
    for out in results:
        for key, value in expected.items():
            torch.testing.assert_close(
                out[f"zero1_{name}"][key], value, atol=OPT_ATOL, rtol=0, msg=key
            )


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_each_rank_keeps_the_state_of_its_own_shard(results, name):
    zero, one = results
    owned = [set(out[f"zero1_{name}_owned"]) for out in results]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert owned[0] | owned[1] == {n for n, _ in initial_model().named_parameters()}
    for out, mine in zip(results, owned):
        assert set(out[f"zero1_{name}_with_state"]) == mine

    model = initial_model()
    optimizer = OPTIMIZERS[name](groups(model), lr=LR, weight_decay=0.1)
    run_optimizer(model, optimizer)
    unsharded = state_bytes(optimizer)
    per_rank = [out[f"zero1_{name}_state_bytes"] for out in results]
    assert sum(per_rank) == unsharded
    # Whole parameters are shared out largest first, so the ranks differ by less than the
    # largest parameter's state (here the 65 x 32 embedding: 16.6 kB of 225 kB).
    largest = 2 * 4 * max(p.numel() for p in model.parameters())
    assert max(per_rank) <= unsharded / 2 + largest / 2
    assert max(per_rank) < 0.6 * unsharded


def test_sharded_optimizer_with_data_parallel_equals_the_unsharded_one(results):
    for out in results:
        assert_states_close(out["data_parallel_sharded"], out["data_parallel_unsharded"], OPT_ATOL)
    moved = max(
        (results[0]["data_parallel_sharded"][k] - v).abs().max()
        for k, v in initial_model().state_dict().items()
    )
    assert moved > 1000 * OPT_ATOL


def test_sharded_optimizer_clear_errors(results):
    for out in results:
        assert "optimizer_cls" in out["not_a_class"] and "not an instance" in out["not_a_class"]
        assert "params[0]" in out["zero1_differ"]
        assert "(3,)" in out["zero1_differ"] and "(4,)" in out["zero1_differ"]


# FSDP.


@pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt2", "llama"])
def test_fsdp_equals_single_process_training(results, cfg):
    key = "fsdp" if cfg is CFG else "fsdp_llama"
    expected = single_process(cfg)
    zero, one = results
    for name, value in zero[key].items():
        assert torch.equal(one[key][name], value), name
        assert value.dtype == torch.float32
    assert_states_close(zero[key], expected, ATOL)
    model = initial_model(cfg)
    model.load_state_dict(zero[key])  # gather_full_params() is a whole state dict


def test_fsdp_gradients_are_reduce_scattered_into_the_slices(results):
    model = initial_model()
    tokens, targets = batches()[0]
    lm_loss(model(tokens), targets).backward()
    for name, p in model.named_parameters():
        shard = math.ceil(p.numel() / 2)
        padded = torch.cat([p.grad.flatten(), torch.zeros(2 * shard - p.numel())])
        for rank, out in enumerate(results):
            assert out["fsdp_shards"][name] == shard, name
            expected = padded[rank * shard : (rank + 1) * shard]
            got = out["fsdp_first_grads"][name]
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=name)


@pytest.mark.parametrize("dtype", HALF_ATOL, ids=str)
def test_fsdp_mixed_precision_equals_single_process_mixed_precision(results, dtype):
    expected = mixed_precision_reference(dtype)
    for out in results:
        assert out[f"fsdp_{dtype}_logits"] == dtype  # the compute ran in `dtype`
        assert_states_close(out[f"fsdp_{dtype}"], expected, HALF_ATOL[dtype])
    moved = max((expected[k] - v).abs().max() for k, v in initial_model().state_dict().items())
    assert moved > 20 * HALF_ATOL[dtype]


def test_fsdp_whole_parameters_live_only_while_needed(results):
    for out in results:
        n_params = sum(len(list(m.parameters(recurse=False))) for m in initial_model().modules())
        assert out["forward_gathers"] == n_params  # each use once (the tied W_E twice)
        # Inside a unit's forward only its own parameters are whole; after it, none.
        assert all(alive == own for alive, own in out["inside"])
        assert out["after"] == [0] * len(out["inside"])
        assert out["alive_after_forward"] == 0
        assert out["backward_gathers"] > 0  # gathered again for the backward
        assert out["alive_after_backward"] == 0


def test_fsdp_keeping_small_parameters_whole_equals_single_process_training(results):
    expected = single_process()
    whole = {n: p for n, p in initial_model().named_parameters() if p.numel() < REPLICATE_BELOW}
    assert all("ln" in n or n.split(".")[-1].startswith("b") for n in whole), sorted(whole)
    zero, one = results
    assert sorted(zero["replicated_whole"]) == sorted(whole)
    for name, value in zero["replicated_whole"].items():
        assert value.shape == whole[name].shape and torch.equal(
            one["replicated_whole"][name], value
        )
        assert not torch.equal(value, whole[name]), name  # trained
    assert_states_close(zero["replicated"], expected, ATOL)


def test_fsdp_keeping_small_parameters_whole_sends_what_the_formula_says(results):
    formula = collective_bytes_per_step(CFG, "fsdp", world_size=2, replicate_below=REPLICATE_BELOW)
    assert formula["all_reduce"] == 4 * sum(
        p.numel() for p in initial_model().parameters() if p.numel() < REPLICATE_BELOW
    )
    everything = collective_bytes_per_step(CFG, "fsdp", world_size=2)
    for out in results:
        sent = out["replicated_bytes"]
        assert sent["all_reduce"] == formula["all_reduce"]
        assert 1 <= sent["reduce_scatter"] / formula["reduce_scatter"] < 1.01
        assert formula["all_gather"] / 2 < sent["all_gather"] <= formula["all_gather"]
        assert formula["reduce_scatter"] < everything["reduce_scatter"]
    with pytest.raises(ValueError, match="replicate_below: expected an int >= 0, got -1"):
        collective_bytes_per_step(CFG, "fsdp", world_size=2, replicate_below=-1)


def test_fsdp_equals_pytorch_fully_shard(results):
    for out in results:
        assert_states_close(out["fsdp"], out["fully_shard"], ATOL)


def test_fsdp_clear_errors(results):
    for out in results:
        assert "compute_dtype" in out["fsdp_dtype"] and "torch.int32" in out["fsdp_dtype"]
        assert out["fsdp_replicate_-1"] == "replicate_below: expected an int >= 0, got -1"
        assert out["fsdp_replicate_1.5"] == "replicate_below: expected an int >= 0, got 1.5"
        assert "'pos_embed.W_pos'" in out["fsdp_differ"]
        assert "(16, 32)" in out["fsdp_differ"] and "(8, 32)" in out["fsdp_differ"]


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        FullyShardedDataParallel(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), torch.optim.AdamW)
