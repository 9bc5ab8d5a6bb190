"""Running on forked gloo ranks and counting what they send (`transformer_course.ranks`), and the
formula of the bytes per step (`step_cost.collective_bytes_per_step`) against that count: the
payloads are exact (ints), so the count must equal the tensors' sizes; the formula leaves out
DataParallel's flags (4 bytes per parameter tensor) and FSDP's padding, within 1%."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from transformer_course.data_parallel import DataParallel
from transformer_course.gpt2 import GPT2, GPT2Config, lm_loss
from transformer_course.ranks import CollectiveBytes, on_ranks
from transformer_course.sharded import FullyShardedDataParallel
from transformer_course.step_cost import collective_bytes_per_step

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")
CFG = GPT2Config(d_model=16, n_layers=1, n_heads=2, d_vocab=29, n_ctx=8)


def collectives(rank: int) -> dict:
    t = torch.full((5,), float(rank + 1))
    with CollectiveBytes() as sent:
        dist.all_reduce(t)
        dist.broadcast(torch.zeros(3, dtype=torch.float64), src=0)
        with sent.paused():
            dist.all_reduce(torch.zeros(100))
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, torch.full((2,), float(rank)))
        dist.reduce_scatter_tensor(torch.empty(1), torch.ones(2))
    return {
        "sum": t,
        "bytes": sent.bytes,
        "calls": sent.calls,
        "gathered": out,
        "all_reduce": dist.all_reduce,
    }


def test_on_ranks_runs_each_rank_and_counts_payloads():
    results = on_ranks(collectives)
    for result in results:
        assert torch.equal(result["sum"], torch.full((5,), 3.0))
        assert torch.equal(result["gathered"], torch.tensor([0.0, 0.0, 1.0, 1.0]))
        assert result["bytes"] == {
            "all_reduce": 20,
            "broadcast": 24,
            "all_gather": 16,
            "reduce_scatter": 8,
        }
        kinds = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
        assert result["calls"] == dict.fromkeys(kinds, 1)  # the paused all-reduce not counted
        assert result["all_reduce"] is dist.all_reduce  # restored after the block


def one_step(rank: int, parallel: str) -> dict:
    torch.manual_seed(0)
    model = GPT2(CFG)
    wrapped = DataParallel(model) if parallel == "ddp" else FullyShardedDataParallel(model)
    tokens = torch.randint(0, CFG.d_vocab, (2, 9), generator=torch.Generator().manual_seed(rank))
    with CollectiveBytes() as sent:
        lm_loss(wrapped(tokens[:, :-1]), tokens[:, 1:]).backward()
        wrapped.finish_gradient_synchronization()
    return sent.bytes


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_formula_is_what_the_wrappers_send(parallel):
    sent = on_ranks(one_step, parallel)[0]
    formula = collective_bytes_per_step(CFG, parallel, world_size=2)
    gradients = "all_reduce" if parallel == "ddp" else "reduce_scatter"
    assert 1 <= sent[gradients] / formula[gradients] < 1.01
    if parallel == "fsdp":
        assert formula["all_gather"] / 2 < sent["all_gather"] <= formula["all_gather"]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="parallel: expected 'ddp', 'zero1' or 'fsdp'"):
        collective_bytes_per_step(CFG, "tp", world_size=2)
    with pytest.raises(ValueError, match="world_size"):
        on_ranks(collectives, world_size=0)
