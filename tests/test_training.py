"""The shared training loop: schedules, optimizer groups, checkpoints and resumption."""

from __future__ import annotations

import io
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from forkserver import PYTHON
from torch import nn

from transformer_course.attention import set_fast_path
from transformer_course.gpt2 import GPT2, GPT2Config
from transformer_course.llama import Llama, LlamaConfig
from transformer_course.training import (
    BEST_NAME,
    CHECKPOINT_NAME,
    TrainConfig,
    atomic_write,
    compiled_blocks,
    cosine_lr,
    estimate_loss,
    inverse_sqrt_lr,
    load_checkpoint,
    lr_at,
    make_optimizer,
    read_checkpoint,
    sample_batch,
    save_checkpoint,
    train,
)


class Tiny(nn.Module):
    """A small regression model with dropout, so resumption must restore the RNG too."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 1)
        )

    def forward(self, x):
        return self.net(x)


def get_batch(step: int):
    # Uses the global RNG on purpose: resumption must restore it.
    x = torch.randn(8, 4)
    noise = float(np.random.rand())
    return x, x.sum(-1, keepdim=True) + noise


def mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def config(**overrides) -> TrainConfig:
    settings = dict(
        max_steps=20,
        lr=1e-2,
        warmup_steps=3,
        lr_schedule="cosine",
        weight_decay=0.1,
        progress=False,
    )
    settings.update(overrides)
    return TrainConfig(**settings)


def test_inverse_sqrt_matches_the_paper_formula():
    # Vaswani et al. (2017), eq. 3: lrate = d_model^-0.5 * min(n^-0.5, n * warmup^-1.5),
    # n = step + 1.
    d_model, warmup = 512, 4000
    for step in (0, 1, 999, 3998, 3999, 4000, 10_000, 99_999):
        n = step + 1
        paper = d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)
        ours = inverse_sqrt_lr(step, lr=(d_model * warmup) ** -0.5, warmup_steps=warmup)
        assert ours == pytest.approx(paper, rel=1e-12)


def test_cosine_schedule_endpoints():
    # Written out by hand: warmup is linear, the midpoint of the cosine is halfway, the end is
    # min_lr.
    assert cosine_lr(0, lr=1.0, warmup_steps=10, max_steps=110) == pytest.approx(0.1)
    assert cosine_lr(9, lr=1.0, warmup_steps=10, max_steps=110) == pytest.approx(1.0)
    assert cosine_lr(60, lr=1.0, warmup_steps=10, max_steps=110, min_lr=0.2) == pytest.approx(0.6)
    assert cosine_lr(110, lr=1.0, warmup_steps=10, max_steps=110, min_lr=0.2) == pytest.approx(0.2)
    assert lr_at(config(lr_schedule=lambda s: 0.5 * s), 4) == 2.0


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(lr_schedule="linear"), "lr_schedule"),
        (dict(lr=0.0), "lr: expected a finite number .*> 0, got 0.0"),
        (dict(lr=math.inf), "lr: .* got inf"),
        (dict(lr=math.nan), "lr: .* got nan"),
        (dict(grad_clip=-1.0), "grad_clip: .* got -1.0"),
        (dict(max_steps=-1), "max_steps: expected an int >= 0, got -1"),
        (dict(max_steps=2.5), "max_steps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(checkpoint_every=5), "checkpoint_dir: checkpoint_every is set"),
        (dict(best_metric=""), "best_metric"),
    ],
)
def test_bad_config_is_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**{"max_steps": 1, "lr": 1e-3, **settings})


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path):
    not_a_folder = tmp_path / "runs"
    not_a_folder.write_text("x")
    message = f"checkpoint_dir: expected a directory, got the file {not_a_folder}"
    with pytest.raises(ValueError, match=message):
        config(checkpoint_dir=not_a_folder)


def test_weight_decay_only_on_matrices():
    class WithHeadBias(nn.Module):
        def __init__(self):
            super().__init__()
            self.W_Q = nn.Parameter(torch.randn(2, 4, 3))
            self.b_Q = nn.Parameter(torch.zeros(2, 3))  # 2-d, but a bias
            self.ln = nn.LayerNorm(4)
            self.embed = nn.Embedding(10, 4)

    model = WithHeadBias()
    decay, no_decay = make_optimizer(model, config()).param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = lambda group: {id(p) for p in group["params"]}  # noqa: E731
    assert ids(decay) == {id(model.W_Q), id(model.embed.weight)}
    assert ids(no_decay) == {id(model.b_Q), id(model.ln.weight), id(model.ln.bias)}


def test_train_equals_a_hand_written_adamw_loop():
    cfg = config(grad_clip=0.5)
    torch.manual_seed(1)
    model = Tiny()
    reference = Tiny()
    reference.load_state_dict(model.state_dict())
    history = train(model, cfg, get_batch, mse)

    # The same steps with torch's AdamW, written out directly.
    decay = [p for n, p in reference.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in reference.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        betas=(0.9, 0.95),
    )
    torch.manual_seed(0)
    np.random.seed(0)
    reference.train()
    losses = []
    for step in range(cfg.max_steps):
        lr = cosine_lr(step, lr=1e-2, warmup_steps=3, max_steps=20)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = mse(reference, get_batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert history.train_loss == pytest.approx(losses, rel=1e-6)
    assert len(history.lr) == len(history.grad_norm) == cfg.max_steps
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_evaluate_is_called_in_eval_mode_without_grad():
    seen = []

    def evaluate(model):
        seen.append((model.training, torch.is_grad_enabled()))
        return {"valid_loss": 1.0}

    history = train(Tiny(), config(max_steps=10, eval_every=4), get_batch, mse, evaluate=evaluate)
    assert [e["step"] for e in history.evals] == [4, 8, 10]
    assert seen == [(False, False)] * 3


def test_resume_equals_uninterrupted(tmp_path):
    torch.manual_seed(3)
    initial = Tiny().state_dict()

    def run(max_steps, folder):
        model = Tiny()
        model.load_state_dict(initial)
        cfg = config(
            max_steps=max_steps,
            lr_schedule="inverse_sqrt",
            checkpoint_every=5,
            checkpoint_dir=folder,
        )
        return model, train(model, cfg, get_batch, mse)

    full_model, full = run(20, tmp_path / "full")
    run(10, tmp_path / "split")  # stops after step 10, leaving its checkpoint
    torch.manual_seed(123)  # disturb every RNG: the checkpoint must restore them
    np.random.seed(123)
    resumed_model, resumed = run(20, tmp_path / "split")
    assert resumed.train_loss == full.train_loss  # bit-identical
    for a, b in zip(full_model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    cfg = config(max_steps=5, checkpoint_every=5, checkpoint_dir=tmp_path)
    train(Tiny(), cfg, get_batch, mse)
    path = tmp_path / CHECKPOINT_NAME
    before = path.read_bytes()

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        train(
            Tiny(),
            config(max_steps=10, checkpoint_every=5, checkpoint_dir=tmp_path),
            get_batch,
            mse,
        )
    assert path.read_bytes() == before  # the old checkpoint is untouched
    assert os.listdir(tmp_path) == [CHECKPOINT_NAME]  # and no temporary file is left behind


def test_resuming_another_architecture_names_the_difference(tmp_path):
    train(Tiny(16), config(max_steps=2, checkpoint_dir=tmp_path), get_batch, mse)
    with pytest.raises(
        ValueError, match=r"net\.0\.weight: checkpoint shape \(16, 4\), this model \(32, 4\)"
    ):
        train(Tiny(32), config(max_steps=4, checkpoint_dir=tmp_path), get_batch, mse)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt", Tiny())


def test_progress_prints_plain_lines_in_notebooks(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ipykernel", sys)  # pretend to run inside Jupyter
    train(Tiny(), config(max_steps=6, log_every=3, progress=True), get_batch, mse)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].strip() for line in lines] == ["step      3", "step      6"]


class FakeStderr:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty", [False, True])
def test_a_log_file_gets_plain_lines_and_a_terminal_gets_a_bar(capsys, monkeypatch, tty):
    stderr = FakeStderr(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    train(Tiny(), config(max_steps=40, log_every=20, progress=True), get_batch, mse)
    out = capsys.readouterr().out
    if tty:
        assert "40/40" in stderr.text and "step     20" in out  # tqdm's bar, log lines above it
    else:
        # One line per log interval, nothing on stderr: no tqdm line per update flooding a log file.
        assert stderr.text == ""
        steps = [line.split("|")[0].strip() for line in out.splitlines()]
        assert steps == ["step     20", "step     40"]


def evaluate_by_schedule(values):
    """An `evaluate` returning the given validation losses in turn, and the weights it saw."""
    seen = []

    def evaluate(model):
        seen.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"valid_loss": values[len(seen) - 1]}

    return evaluate, seen


def test_the_best_evaluation_is_kept_and_saved_only_when_it_improves(tmp_path, monkeypatch):
    evaluate, seen = evaluate_by_schedule([3.0, 2.0, 2.5, 2.0, 2.2])  # a tie is no improvement
    writes = []

    def recording_save(path, *args):
        writes.append(Path(path).name)
        save_checkpoint(path, *args)

    monkeypatch.setitem(train.__globals__, "save_checkpoint", recording_save)
    model = Tiny()
    cfg = config(max_steps=10, eval_every=2, checkpoint_dir=tmp_path, best_metric="valid_loss")
    history = train(model, cfg, get_batch, mse, evaluate=evaluate)
    assert history.best == {"step": 4, "valid_loss": 2.0}
    assert writes == [BEST_NAME, BEST_NAME, CHECKPOINT_NAME]  # steps 2 and 4 improve; then the last
    for name, value in seen[1].items():  # the weights evaluated at step 4
        assert torch.equal(history.best_state[name], value)
        assert torch.equal(read_checkpoint(tmp_path / BEST_NAME)["model"][name], value)
    assert read_checkpoint(tmp_path / BEST_NAME)["step"] == 4
    # The model itself, and checkpoint.pt, stay at the last step.
    assert read_checkpoint(tmp_path / CHECKPOINT_NAME)["step"] == 10
    for name, value in model.state_dict().items():
        assert torch.equal(value, seen[-1][name])
    assert history.to_dict()["best"] == {"step": 4, "valid_loss": 2.0}
    assert "best_state" not in history.to_dict()


def test_the_best_evaluation_survives_resumption(tmp_path):
    def run(max_steps, losses):
        evaluate, seen = evaluate_by_schedule(losses)
        cfg = config(
            max_steps=max_steps,
            eval_every=2,
            checkpoint_every=2,
            checkpoint_dir=tmp_path,
            best_metric="valid_loss",
        )
        return train(Tiny(), cfg, get_batch, mse, evaluate=evaluate), seen

    _, seen = run(4, [3.0, 1.0])  # best at step 4
    resumed, _ = run(8, [2.0, 1.5])  # resumed at step 4; neither step 6 nor 8 beats it
    assert resumed.best == {"step": 4, "valid_loss": 1.0}
    for name, value in seen[1].items():
        assert torch.equal(resumed.best_state[name], value)


def test_best_metric_must_be_returned_by_evaluate():
    with pytest.raises(ValueError, match="best_metric: 'val_loss' is not among evaluate's metrics"):
        train(
            Tiny(),
            config(max_steps=2, eval_every=1, best_metric="val_loss"),
            get_batch,
            mse,
            evaluate=lambda m: {"valid_loss": 1.0},
        )
    with pytest.raises(ValueError, match="evaluate"):
        train(Tiny(), config(max_steps=2, best_metric="valid_loss"), get_batch, mse)


def test_non_finite_gradients_stop_training_and_the_last_good_checkpoint_survives(tmp_path):
    torch.manual_seed(4)
    model = Tiny()

    def loss_fn(model, batch):
        x, y, poisoned = batch
        loss = mse(model, (x, y))
        if poisoned:  # a finite loss with NaN gradients: d sqrt(u) / du is infinite at u = 0
            loss = loss + torch.sqrt(0 * model.net[0].weight.sum())
        return loss

    cfg = config(max_steps=20, checkpoint_every=5, checkpoint_dir=tmp_path, log_every=10)
    path = tmp_path / CHECKPOINT_NAME
    message = r"step 6: loss [0-9.]+, gradient norm nan: not finite.*\(step 5\) is intact"
    with pytest.raises(FloatingPointError, match=message):
        train(model, cfg, lambda step: (*get_batch(step), step == 6), loss_fn)
    saved = read_checkpoint(path)
    assert saved["step"] == 5 and all(t.isfinite().all() for t in saved["model"].values())
    assert all(p.isfinite().all() for p in model.parameters())  # the NaN update was never applied


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty, truncated or not a checkpoint \\(0 bytes\\)"),
        (b"not a zip file at all", "empty, truncated or not a checkpoint"),
        (b"half a file", "empty, truncated or not a checkpoint"),  # pickle's memo lookup fails
    ],
)
def test_an_unreadable_checkpoint_names_the_file(tmp_path, content, message):
    path = tmp_path / CHECKPOINT_NAME
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"checkpoint {path}: cannot be read.*{message}"):
        train(Tiny(), config(max_steps=2, checkpoint_dir=tmp_path), get_batch, mse)


def test_a_truncated_or_incomplete_checkpoint_names_the_file_and_field(tmp_path):
    train(Tiny(), config(max_steps=2, checkpoint_dir=tmp_path), get_batch, mse)
    path = tmp_path / CHECKPOINT_NAME
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=f"checkpoint {path}: cannot be read"):
        load_checkpoint(path, Tiny())
    checkpoint = torch.load(io.BytesIO(whole), weights_only=True)
    del checkpoint["architecture"]
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=f"checkpoint {path}: the field 'architecture' is missing"):
        load_checkpoint(path, Tiny())
    torch.save({**checkpoint, "architecture": {}, "step": -2}, path)
    with pytest.raises(ValueError, match="field 'step' must be an int >= 0, got -2"):
        load_checkpoint(path, Tiny())
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match=f"checkpoint {path}: expected a dict"):
        load_checkpoint(path, Tiny())


def test_a_pickled_object_is_refused_without_torchs_advice(tmp_path):
    path = tmp_path / CHECKPOINT_NAME
    torch.save({"model": Tiny()}, path)  # a whole module: needs unpickling arbitrary classes
    with pytest.raises(ValueError, match="not written by this course; refusing") as error:
        read_checkpoint(path)
    assert "weights_only=False" not in str(error.value)


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "results.json"
    atomic_write(path, "old")

    def fail(f):
        f.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]
    atomic_write(path, b"new")
    assert path.read_text() == "new"


def test_runs_under_distributed_data_parallel(tmp_path):
    import torch.distributed as dist

    torch.manual_seed(5)
    model, reference = Tiny(), Tiny()
    reference.load_state_dict(model.state_dict())
    expected = train(reference, config(max_steps=5), get_batch, mse)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        history = train(model, config(max_steps=5), get_batch, mse)
    finally:
        dist.destroy_process_group()
    assert history.train_loss == pytest.approx(expected.train_loss, rel=1e-6)


KILLABLE_RUN = """
import sys, time, torch
from torch import nn
from transformer_course.training import TrainConfig, train

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))

def get_batch(step):
    time.sleep(float(sys.argv[2]))  # slow enough to be killed mid-run
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(-1, keepdim=True)

def loss_fn(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])

cfg = TrainConfig(max_steps=40, lr=1e-2, lr_schedule="inverse_sqrt", warmup_steps=5,
                  checkpoint_every=5, checkpoint_dir=sys.argv[1], progress=False)
history = train(model, cfg, get_batch, loss_fn)
print(repr(history.train_loss[-1]))
"""


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_final_loss(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(KILLABLE_RUN))

    def finish(folder: Path, delay: str = "0") -> str:
        done = subprocess.run(  # PYTHON: `python`, without importing torch again
            [*PYTHON, str(script), str(folder), delay],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    uninterrupted = finish(tmp_path / "a")

    folder = tmp_path / "b"
    # A plain process, not forked: SIGKILL stops the program itself, at once.
    victim = subprocess.Popen([sys.executable, str(script), str(folder), "0.05"])
    deadline = time.monotonic() + 60
    while not (folder / CHECKPOINT_NAME).exists():
        assert victim.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    saved = torch.load(folder / CHECKPOINT_NAME, weights_only=True)["step"]
    assert 0 < saved < 40  # killed part-way
    assert finish(folder) == uninterrupted
    assert not math.isnan(float(uninterrupted))


# Data for next-token prediction.


def test_sample_batch_targets_are_inputs_shifted_by_one():
    data = torch.arange(100)
    x, y = sample_batch(data, 5, 8, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 8)
    assert torch.equal(y, x + 1)  # data[i] == i
    assert int(y.max()) <= 99


def test_sample_batch_reaches_every_window_and_repeats_with_a_generator():
    data = torch.arange(10)
    x, y = sample_batch(data, 500, 4, generator=torch.Generator().manual_seed(1))
    assert sorted(x[:, 0].unique().tolist()) == [0, 1, 2, 3, 4, 5]  # the last one ends at data[-1]
    again, _ = sample_batch(data, 500, 4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(x, again)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.arange(8), 2, 8), "data: expected a 1-d tensor longer than n_ctx=8"),
        ((torch.zeros(2, 20), 2, 4), r"got shape \(2, 20\)"),
        ((torch.arange(20), 0, 4), "batch_size: expected a positive int, got 0"),
        ((torch.arange(20), 2, 2.0), "n_ctx: expected a positive int, got 2.0"),
    ],
)
def test_sample_batch_refuses_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        sample_batch(*args)


class Bigram(nn.Module):
    """Logits that depend on the current token only, with dropout (so eval mode matters)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(7, 7)
        self.dropout = nn.Dropout(0.5)

    def forward(self, tokens):
        return self.dropout(self.table(tokens))


def test_estimate_loss_is_the_mean_eval_loss_and_restores_train_mode():
    torch.manual_seed(0)
    model = Bigram().train()
    data = torch.randint(0, 7, (200,), generator=torch.Generator().manual_seed(2))
    loss = estimate_loss(
        model,
        data,
        batch_size=4,
        n_ctx=5,
        n_batches=3,
        generator=torch.Generator().manual_seed(3),
    )
    assert model.training
    generator, losses = torch.Generator().manual_seed(3), []
    for _ in range(3):
        x, y = sample_batch(data, 4, 5, generator=generator)
        logits = model.table(x)  # no dropout: eval mode
        losses.append(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    assert loss == pytest.approx(sum(losses) / 3, rel=1e-6)
    with pytest.raises(ValueError, match="n_batches: expected a positive int, got 0"):
        estimate_loss(model, data, batch_size=4, n_ctx=5, n_batches=0)


DECODERS = {  # the models whose blocks chapters 6 and 7 train compiled on a GPU
    "GPT2": lambda: GPT2(GPT2Config(d_model=32, n_layers=3, n_heads=4, d_vocab=65, n_ctx=32)),
    "Llama": lambda: Llama(
        LlamaConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_vocab=65, n_ctx=32)
    ),
}


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_compiled_blocks_trace_without_a_break_and_compute_what_eager_does(name):
    """One graph for training and one without gradients serve every block, whatever the length;
    the outputs and gradients are eager's; after the `with`, the blocks are eager again."""
    graphs = []

    def backend(graph: torch.fx.GraphModule, example_inputs):
        graphs.append(graph)
        return graph.forward  # run as traced: the graphs are checked here, not the kernels

    torch.manual_seed(0)
    model, eager = set_fast_path(DECODERS[name]()), set_fast_path(DECODERS[name]())
    eager.load_state_dict(model.state_dict())
    torch._dynamo.reset()
    with compiled_blocks(model.blocks, backend=backend, fullgraph=True):
        for length in (24, 17, 9):
            tokens = torch.randint(
                0, 65, (4, length), generator=torch.Generator().manual_seed(length)
            )
            outputs = [m(tokens) for m in (model, eager)]
            for out in outputs:
                out.logsumexp(-1).mean().backward()
            torch.testing.assert_close(outputs[0], outputs[1], atol=1e-6, rtol=0)
            for p, q in zip(model.parameters(), eager.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)
                p.grad = q.grad = None
            with torch.no_grad():
                torch.testing.assert_close(model.eval()(tokens), eager.eval()(tokens))
            model.train(), eager.train()
    torch._dynamo.reset()
    assert len(graphs) <= 3, f"{len(graphs)} graphs"  # training, evaluation, a length of 1 aside
    assert not any("forward" in vars(block) for block in model.blocks)


def test_compiled_blocks_refuse_a_model_and_restore_every_forward_after_an_error():
    model = DECODERS["GPT2"]()
    with pytest.raises(
        TypeError, match=r"blocks: expected the blocks \(e.g. model.blocks\), got GPT2"
    ):
        with compiled_blocks(model):
            pass
    with pytest.raises(TypeError, match="blocks: expected nn.Modules, got Tensor"):
        with compiled_blocks([torch.zeros(2)]):
            pass
    with compiled_blocks(model.blocks, backend="eager"):
        outer = vars(model.blocks[0])["forward"]
        with pytest.raises(RuntimeError, match="stopped"):
            with compiled_blocks(model.blocks, backend="eager"):
                raise RuntimeError("stopped")
        assert vars(model.blocks[0])["forward"] is outer  # the inner `with` gave it back
    assert not any("forward" in vars(block) for block in model.blocks)
