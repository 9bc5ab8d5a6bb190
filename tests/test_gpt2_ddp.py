"""Multi-process training: `torchrun --nproc_per_node=2` on the CPU (gloo) computes the same
updates as one process with the same global batch, with PyTorch's DistributedDataParallel and
with chapter 8's `--parallel ddp` and `--parallel fsdp`.

Both runs use `scripts/train_gpt2.py` on a small text with a tiny model for a few steps. Each
rank takes half of every global batch and DistributedDataParallel averages the gradients, so
the final parameters agree up to float32 summation order: we allow atol 1e-5 (the parameters
are O(0.1); a lost gradient average or a rank training on the wrong shard moves them by ~1e-3).
Every process, torchrun's ranks too, starts through `tests/forkserver.py`: as `python` would
run it, without importing torch and TransformerLens again.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch
from forkserver import PYTHON

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_gpt2.py"
TINY = (
    "--n-layers 1 --n-heads 2 --d-model 16 --block-size 16 --batch-size 8 --max-steps 6 "
    "--warmup-steps 2 --lr 3e-3 --eval-every 3 --eval-batches 2 --sample-tokens 0"
).split()
WORDS = "to be or not the king queen of thee shall and my lord".split()


def run(command: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, (
        f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )


needs_distributed = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, list[str]]:
    """One process trained on a small text: its folder (checkpoint.pt, results.json), and the
    command's common part for the runs on two processes."""
    folder = tmp_path_factory.mktemp("ddp")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(400))
    text_file = folder / "text.txt"
    text_file.write_text(text)
    common = [str(SCRIPT), "--text-file", str(text_file), "--device", "cpu", *TINY]
    one = folder / "one"
    run([*PYTHON, *common, "--checkpoint-dir", str(one), "--out", str(one)], folder)
    return folder, common


# torchrun, and each rank as `python SCRIPT ...`, started through the fork server.
TWO_PROCESSES = [
    *PYTHON,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node=2",
    "--no-python",
    *PYTHON,
]


@pytest.mark.slow
@needs_distributed
def test_two_processes_match_one_process(one_process):
    tmp_path, common = one_process
    two = str(tmp_path / "two")
    run([*TWO_PROCESSES, *common, "--checkpoint-dir", two, "--out", two], tmp_path)

    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)
    assert one["step"] == two["step"] == 6
    for name, expected in one["model"].items():
        torch.testing.assert_close(two["model"][name], expected, atol=1e-5, rtol=0, msg=name)
    # The losses each step (averaged over ranks in the DDP run) agree too.
    torch.testing.assert_close(
        torch.tensor(two["history"]["train_loss"]),
        torch.tensor(one["history"]["train_loss"]),
        atol=1e-5,
        rtol=0,
    )
    losses = one["history"]["train_loss"]
    assert losses[-1] < losses[0] - 0.05, f"training did not move: {losses}"


@pytest.mark.slow
@needs_distributed
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_course_wrappers_match_one_process(one_process, parallel):
    """`--parallel ddp|fsdp`: the losses of one process (atol 1e-5, as above), and the bytes
    each rank sent per step: the formula's gradients (within 1%; DataParallel adds a flag per
    parameter, FSDP pads each parameter to an even size), FSDP's gathers at most the bound."""
    tmp_path, common = one_process
    out = str(tmp_path / parallel)
    run([*TWO_PROCESSES, *common, "--parallel", parallel, "--out", out], tmp_path)
    one, two = (
        json.loads((tmp_path / name / "results.json").read_text()) for name in ("one", parallel)
    )
    torch.testing.assert_close(
        torch.tensor(two["history"]["train_loss"]),
        torch.tensor(one["history"]["train_loss"]),
        atol=1e-5,
        rtol=0,
    )
    sent = two["bytes_per_step"]
    gradients = "all_reduce" if parallel == "ddp" else "reduce_scatter"
    assert 1 <= sent["measured"][gradients] / sent["formula"][gradients] < 1.01, sent
    if parallel == "fsdp":
        assert 0 < sent["measured"]["all_gather"] <= sent["formula"]["all_gather"], sent
