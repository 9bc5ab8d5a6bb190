"""`scripts/train_gpt2.py` in one process: settings refused before any work, the best model kept,
reported and sampled, results written atomically, and texts without a newline."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from transformer_course.training import BEST_NAME, CHECKPOINT_NAME, read_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_gpt2.py"
spec = importlib.util.spec_from_file_location("train_gpt2", SCRIPT)
train_gpt2 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train_gpt2)

TINY = (
    "--n-layers 1 --n-heads 2 --d-model 16 --block-size 8 --batch-size 4 --max-steps 8 "
    "--warmup-steps 2 --lr 3e-3 --eval-every 2 --eval-batches 2 --device cpu"
).split()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-steps", "-1"], "--max-steps: expected an int >= 0, got -1"),
        (["--batch-size", "0"], "--batch-size: expected an int >= 1, got 0"),
        (["--grad-clip", "-1"], "grad_clip: expected a finite number .*>= 0, got -1.0"),
        (["--lr", "inf"], "lr: expected a finite number .*> 0, got inf"),
        (["--d-model", "15"], "d_model: expected a multiple of n_heads=2 .*got 15"),
    ],
)
def test_bad_settings_are_refused_before_reading_any_text(flags, message, capsys, tmp_path):
    missing = tmp_path / "no-such-text.txt"  # reading it would fail with another error
    with pytest.raises(SystemExit) as exit_:
        train_gpt2.main([*TINY, "--text-file", str(missing), *flags])
    assert exit_.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_a_checkpoint_dir_that_is_a_file_is_refused(capsys, tmp_path):
    not_a_folder = tmp_path / "checkpoints"
    not_a_folder.write_text("x")
    with pytest.raises(SystemExit):
        train_gpt2.main([*TINY, "--checkpoint-dir", str(not_a_folder)])
    assert "checkpoint_dir: expected a directory" in capsys.readouterr().err


def test_text_without_newline_trains_reports_the_best_and_samples_from_it(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("to be or not to be that is the question " * 40)  # no newline anywhere
    result = train_gpt2.main(
        [
            *TINY,
            "--text-file",
            str(text),
            "--sample-tokens",
            "20",
            "--out",
            str(tmp_path / "out"),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    out = capsys.readouterr().out
    evals = result["history"]["evals"]
    best = min(evals, key=lambda e: e["val_loss"])
    assert result["best"] == {"step": best["step"], "val_loss": best["val_loss"]}
    assert f"best: step {best['step']}: " in out
    assert f"sample from the best model (step {best['step']})" in out
    assert json.loads((tmp_path / "out" / "results.json").read_text())["best"] == result["best"]
    assert read_checkpoint(tmp_path / "ckpt" / BEST_NAME)["step"] == best["step"]
    assert read_checkpoint(tmp_path / "ckpt" / CHECKPOINT_NAME)["step"] == 8  # the last state too
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["results.json"]  # no temporary file
    assert torch.isfinite(torch.tensor(result["history"]["train_loss"])).all()
