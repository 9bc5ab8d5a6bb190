"""Data parallel by hand (`transformer_course.data_parallel`) on two gloo ranks on the CPU.

One fork of two ranks runs every distributed check (`dp_results`); the tests read its results.
References, each independent of the code under test:

- single-process training on the whole batch, in this process: the same steps (SGD with
  momentum, lr 0.5) from the same initial weights. The two ranks' mean gradients equal the
  whole batch's up to float32 summation order (~1e-7 relative), so after 4 steps the
  parameters agree to `ATOL` = 1e-6 (we see 9e-8; they move by ~0.4, and a missing average, a
  rank left out or a gradient reduced twice moves them by 1e-2 or more). SGD, not AdamW:
  AdamW divides each gradient by its own running size, so where a gradient is exactly zero
  (the attention's key biases: the softmax ignores a shift of all of a query's scores) it
  turns the rounding noise of a different summation order into steps of about lr;
- PyTorch's `DistributedDataParallel`, run on the same ranks: it sums the same two numbers per
  element after the same division by 2, so we expect the same bits; we allow 1e-7.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from transformer_course.checks.data_parallel import Branchy
from transformer_course.data_parallel import (
    DataParallel,
    check_same_parameters,
    require_process_group,
)
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss
from transformer_course.ranks import on_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")

CFG = GPT2Config(d_model=32, n_layers=2, n_heads=2, d_vocab=65, n_ctx=16, tie_embeddings=True)
STEPS, BATCH, SEQ, LR = 4, 8, 12, 0.5
ATOL = 1e-6  # against one process on the whole batch (see the module docstring)
DDP_ATOL = 1e-7
BUCKET_MB = 0.01  # 10 KiB: the tiny GPT-2's 27 parameters travel in about 8 buckets


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, CFG.d_vocab, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def initial_model() -> GPT2:
    torch.manual_seed(0)
    return GPT2(CFG)


def train(model: nn.Module, rank: int | None = None, finish=None) -> dict[str, torch.Tensor]:
    """SGD steps on the global batches (on rank r's half of each if `rank` is given)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for tokens, targets in batches():
        if rank is not None:
            half = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
            tokens, targets = tokens[half], targets[half]
        loss = lm_loss(model(tokens), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()
    inner = getattr(model, "module", model)
    return {k: v.detach().clone() for k, v in inner.state_dict().items()}


def branchy_grads(bucket_size_mb, rank: int) -> dict[str, torch.Tensor | None]:
    torch.manual_seed(rank)
    model = DataParallel(Branchy(), bucket_size_mb=bucket_size_mb)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + rank))
    model(x, use_sometimes=rank == 0).pow(2).sum().backward()
    model.finish_gradient_synchronization()
    return {
        n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()
    }


def dp_worker(rank: int) -> dict:
    results: dict = {}
    torch.manual_seed(rank)  # each rank's own weights (rank 0's are `initial_model()`'s)
    results["own_weights"] = GPT2(CFG).state_dict()["blocks.0.attn.W_Q"].clone()

    for name, bucket_size_mb in (("unbucketed", None), ("bucketed", BUCKET_MB)):
        torch.manual_seed(rank)
        model = GPT2(CFG)
        # Registered before DataParallel's hook, so it runs first: when the embedding's gradient
        # (the last one the backward makes) arrives, how many buckets have already left?
        launched, holder = [], {}
        model.embed.W_E.register_post_accumulate_grad_hook(
            lambda p: launched.append(holder["dp"]._next)  # noqa: B023 (used in this iteration)
        )
        dp = holder["dp"] = DataParallel(model, bucket_size_mb=bucket_size_mb)
        results[f"{name}_after_broadcast"] = model.state_dict()["blocks.0.attn.W_Q"].clone()
        results[f"{name}_buckets"] = len(dp._buckets)
        results[name] = train(dp, rank, dp.finish_gradient_synchronization)
        results[f"{name}_launched_before_last"] = launched

    torch.manual_seed(rank)
    ddp = nn.parallel.DistributedDataParallel(GPT2(CFG))  # broadcasts rank 0's weights too
    results["ddp"] = train(ddp, rank)

    results["branchy"] = {str(b): branchy_grads(b, rank) for b in (None, 1e-4)}

    # Bad input: ranks whose models differ, a second forward before the gradients are averaged.
    try:
        DataParallel(GPT2(CFG if rank == 0 else GPT2Config(**{**vars(CFG), "d_mlp": 64})))
    except ValueError as error:
        results["differ"] = str(error)
    check_same_parameters(GPT2(CFG))  # the same on both: no error
    frozen = GPT2(CFG)
    frozen.ln_final.w.requires_grad_(rank == 0)
    try:
        check_same_parameters(frozen, "model")
    except ValueError as error:
        results["differ_requires_grad"] = str(error)
    dp = DataParallel(GPT2(CFG))
    tokens, targets = batches()[0]
    lm_loss(dp(tokens), targets).backward()
    try:
        dp(tokens)
    except RuntimeError as error:
        results["unfinished"] = str(error)
    dp.finish_gradient_synchronization()
    dp(tokens)  # and after it, fine
    try:
        DataParallel(GPT2(CFG), bucket_size_mb=0)
    except ValueError as error:
        results["bucket_size"] = str(error)
    return results


@pytest.fixture(scope="module")
def dp_results() -> list[dict]:
    return on_ranks(dp_worker)


@pytest.fixture(scope="module")
def single_process() -> dict[str, torch.Tensor]:
    return train(initial_model())


def test_rank_0_weights_are_broadcast_at_construction(dp_results):
    zero, one = dp_results
    assert not torch.equal(zero["own_weights"], one["own_weights"])
    for name in ("unbucketed", "bucketed"):
        assert torch.equal(one[f"{name}_after_broadcast"], zero["own_weights"])
        assert torch.equal(zero[f"{name}_after_broadcast"], zero["own_weights"])


@pytest.mark.parametrize("name", ["unbucketed", "bucketed"])
def test_matches_single_process_training_on_the_whole_batch(dp_results, single_process, name):
    zero, one = dp_results
    # Every rank takes the same step from the same averaged gradients: the same bits.
    for key, value in zero[name].items():
        assert torch.equal(one[name][key], value), key
    for key, expected in single_process.items():
        torch.testing.assert_close(zero[name][key], expected, atol=ATOL, rtol=0, msg=key)
    initial = initial_model().state_dict()
    moved = max((single_process[k] - initial[k]).abs().max() for k in single_process)
    assert moved > 10_000 * ATOL  # the training moved the weights far more than the tolerance


@pytest.mark.parametrize("name", ["unbucketed", "bucketed"])
def test_matches_distributed_data_parallel(dp_results, name):
    for results in dp_results:
        for key, expected in results["ddp"].items():
            torch.testing.assert_close(results[name][key], expected, atol=DDP_ATOL, rtol=0, msg=key)


def test_buckets_are_sent_while_the_backward_runs(dp_results):
    """The token embedding's gradient comes last (it is the first parameter, and the tied
    unembedding's use adds to it). By then every other bucket has been sent."""
    for results in dp_results:
        assert results["unbucketed_buckets"] == sum(1 for _ in initial_model().parameters())
        assert 1 < results["bucketed_buckets"] < results["unbucketed_buckets"]
        for name in ("unbucketed", "bucketed"):
            assert (
                results[f"{name}_launched_before_last"] == [results[f"{name}_buckets"] - 1] * STEPS
            )


@pytest.mark.parametrize("bucket_size_mb", ["None", "0.0001"])
def test_shared_frozen_and_unused_parameters(dp_results, bucket_size_mb):
    """Against gradients computed here, in one process, from the two ranks' inputs: the shared
    matrix reduced once (twice would double it), the frozen and the never-used ones without a
    gradient on either rank (and no hang), and the one only rank 0 uses averaged with rank 1's
    zero."""
    zero, one = (r["branchy"][bucket_size_mb] for r in dp_results)
    torch.manual_seed(0)
    model = Branchy()
    losses = []
    for rank in (0, 1):  # rank 0's weights, each rank's input
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + rank))
        losses.append(model(x, use_sometimes=rank == 0).pow(2).sum())
    (sum(losses) / 2).backward()
    for name, p in model.named_parameters():
        for grads in (zero, one):
            if p.grad is None:
                assert grads[name] is None, name
            else:
                torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-6, msg=name)
    assert zero["frozen"] is None and zero["unused"] is None and zero["sometimes"] is not None


def test_clear_errors(dp_results):
    for results in dp_results:
        assert "'blocks.0.mlp.W_in'" in results["differ"]
        assert "(32, 128)" in results["differ"] and "(32, 64)" in results["differ"]
        assert results["differ_requires_grad"].startswith("model: expected the same parameters")
        assert "'ln_final.w'" in results["differ_requires_grad"]
        assert "requires_grad=True on rank 0" in results["differ_requires_grad"]
        assert "finish_gradient_synchronization()" in results["unfinished"]
        assert "bucket_size_mb" in results["bucket_size"]


def test_no_process_group_is_a_clear_error():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        require_process_group()
    with pytest.raises(RuntimeError, match="expected an initialised process group"):
        DataParallel(nn.Linear(2, 2))
