"""The training loop shared by the translation model (chapter 5) and GPT-2 (chapter 6).

One function, `train`, runs AdamW with a learning-rate schedule, gradient clipping, periodic
evaluation, progress reporting and checkpoints. It knows nothing about the model: the caller
passes `get_batch(step)` and `loss_fn(model, batch)`.

Checkpoints hold the model, the optimizer, the step, every random number generator's state and
the history, so a run killed at any point and started again with the same arguments continues
exactly where it stopped (bit-identically on the CPU). Files are written atomically: a crash
while saving leaves the previous checkpoint intact.

Under `torchrun` (when `torch.distributed` is initialised) the model is wrapped in
`DistributedDataParallel`; every rank calls `get_batch(step)`, which must return that rank's
own shard of the step's data; only rank 0 prints and saves.
"""

from __future__ import annotations

import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

Batch = Any
CHECKPOINT_NAME = "checkpoint.pt"
SCHEDULES = ("constant", "cosine", "inverse_sqrt")


@dataclass
class TrainConfig:
    """Everything `train` needs besides the model and the data.

    `lr` is the peak learning rate, reached at the end of `warmup_steps`. `lr_schedule` is one of
    `"constant"`, `"cosine"`, `"inverse_sqrt"` or a function `step -> learning rate`.
    `eval_every=0` and `checkpoint_every=0` mean never (a checkpoint is still written at the end
    when `checkpoint_dir` is set). `amp` turns on bfloat16 autocast, on CUDA only.
    """

    max_steps: int
    lr: float
    warmup_steps: int = 0
    lr_schedule: str | Callable[[int], float] = "constant"
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    eval_every: int = 0
    log_every: int = 50
    checkpoint_every: int = 0
    checkpoint_dir: str | Path | None = None
    amp: bool = True
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_steps < 0:
            raise ValueError(f"max_steps: expected a non-negative number of steps, got {self.max_steps}")
        if not self.lr > 0:
            raise ValueError(f"lr: expected a positive learning rate, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected >= 0, got {self.warmup_steps}")
        if not callable(self.lr_schedule) and self.lr_schedule not in SCHEDULES:
            raise ValueError(f"lr_schedule: expected one of {SCHEDULES} or a function, got {self.lr_schedule!r}")
        for name in ("eval_every", "log_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: expected >= 0, got {getattr(self, name)}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError("checkpoint_dir: checkpoint_every is set, so a directory is needed, got None")


@dataclass
class History:
    """What happened during training: one entry per step, plus one record per evaluation."""

    step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)  # each has a "step" key

    def to_dict(self) -> dict[str, list]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, list]) -> History:
        return cls(**{f.name: list(data[f.name]) for f in fields(cls)})


# Learning-rate schedules: plain functions of the step, so a notebook can plot them.


def constant_lr(step: int, *, lr: float, warmup_steps: int = 0) -> float:
    """`lr` after a linear warmup from `lr / warmup_steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr


def cosine_lr(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr: float = 0.0) -> float:
    """Linear warmup to `lr`, then half a cosine down to `min_lr` at `max_steps`."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def inverse_sqrt_lr(step: int, *, lr: float, warmup_steps: int) -> float:
    """Vaswani et al.'s schedule: linear warmup to `lr`, then decay proportional to 1/sqrt(step).

    The paper writes it as `d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)` with `n = step + 1`;
    that is this function with `lr = (d_model * warmup_steps) ** -0.5`.
    """
    n = step + 1
    warmup = max(1, warmup_steps)
    return lr * min(n / warmup, math.sqrt(warmup / n))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate `cfg` asks for at `step` (counted from 0)."""
    if callable(cfg.lr_schedule):
        return float(cfg.lr_schedule(step))
    if cfg.lr_schedule == "cosine":
        return cosine_lr(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr=cfg.min_lr)
    if cfg.lr_schedule == "inverse_sqrt":
        return inverse_sqrt_lr(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps)
    return constant_lr(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps)


def _decays(name: str, param: nn.Parameter) -> bool:
    """Weight decay applies to matrices only: not to biases (`b`, `b_Q`, `bias`, ...) or norm gains."""
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim >= 2 and not (leaf in ("b", "bias") or leaf.startswith("b_"))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with two groups: weight decay on matrices (embeddings included), none on biases and norms.

    Uses the fused CUDA kernel when the model lives on a GPU.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if _decays(n, p)]
    no_decay = [p for n, p in params if not _decays(n, p)]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = bool(params) and params[0][1].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)


# Checkpoints.


def _architecture(model: nn.Module) -> dict[str, Any]:
    """What must match for a checkpoint to load: the model's config and every parameter's shape."""
    config = getattr(model, "cfg", None)
    return {
        "config": asdict(config) if is_dataclass(config) else None,
        "shapes": {name: tuple(t.shape) for name, t in model.state_dict().items()},
    }


def _describe_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    problems = []
    if saved["config"] is not None and current["config"] is not None:
        for key in sorted(set(saved["config"]) | set(current["config"])):
            old, new = saved["config"].get(key), current["config"].get(key)
            if old != new:
                problems.append(f"config {key}: checkpoint {old!r}, this model {new!r}")
    old_shapes, new_shapes = saved["shapes"], current["shapes"]
    for name in sorted(set(old_shapes) | set(new_shapes)):
        old, new = old_shapes.get(name), new_shapes.get(name)
        if old is None:
            problems.append(f"parameter {name}: missing from the checkpoint")
        elif new is None:
            problems.append(f"parameter {name}: in the checkpoint but not in this model")
        elif tuple(old) != tuple(new):
            problems.append(f"parameter {name}: checkpoint shape {tuple(old)}, this model {tuple(new)}")
    return problems


def _rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary file in the same folder, then rename: the old file survives a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int, history: History
) -> None:
    """Save everything needed to resume after `step` completed steps."""
    _atomic_save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "step": step,
            "rng": _rng_state(),
            "history": history.to_dict(),
            "architecture": _architecture(model),
        },
        Path(path),
    )


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint into `model` (and `optimizer`); returns the whole checkpoint dict.

    A checkpoint from a different architecture is refused with a list of what differs.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    problems = _describe_mismatch(checkpoint["architecture"], _architecture(model))
    if problems:
        raise ValueError(
            f"checkpoint {path} was saved from a different model; use another checkpoint_dir or the "
            "same configuration:\n  " + "\n  ".join(problems)
        )
    model.load_state_dict(checkpoint["model"])
    if optimizer is not None and checkpoint["optimizer"] is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint


# Progress reporting.


def _in_notebook() -> bool:
    """True inside Jupyter, where we print plain lines instead of drawing a tqdm bar."""
    return "ipykernel" in sys.modules and not sys.stderr.isatty()


def _format(record: dict[str, float]) -> str:
    parts = [f"step {record['step']:>6d}"]
    for key, value in record.items():
        if key == "step":
            continue
        parts.append(f"{key} {value:.2e}" if key == "lr" else f"{key} {value:.4f}")
    return " | ".join(parts)


def train(
    model: nn.Module,
    cfg: TrainConfig,
    get_batch: Callable[[int], Batch],
    loss_fn: Callable[[nn.Module, Batch], Tensor],
    *,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    on_log: Callable[[dict[str, float]], None] | None = None,
) -> History:
    """Train `model` for `cfg.max_steps` steps and return its `History`.

    `get_batch(step)` returns the batch for a step (on the model's device). It should depend only
    on `step` (seed a generator with it) so a resumed run sees the same data; under DDP it must
    return this rank's shard. `loss_fn(model, batch)` returns a scalar loss. `evaluate(model)`,
    called every `cfg.eval_every` steps and at the end in eval mode without gradients, returns
    metrics such as `{"valid_loss": ...}`. `on_log(record)` receives each logged record.

    If `cfg.checkpoint_dir` holds a checkpoint, training resumes from it.
    """
    distributed = dist.is_available() and dist.is_initialized()
    is_main = not distributed or dist.get_rank() == 0
    device = next(model.parameters()).device
    raw_model = model
    if distributed:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if optimizer is None:
        optimizer = make_optimizer(raw_model, cfg)
    history = History()
    start = 0
    checkpoint_path = Path(cfg.checkpoint_dir) / CHECKPOINT_NAME if cfg.checkpoint_dir is not None else None
    if checkpoint_path is not None and checkpoint_path.exists():
        checkpoint = load_checkpoint(checkpoint_path, raw_model, optimizer)
        start = checkpoint["step"]
        history = History.from_dict(checkpoint["history"])
        _set_rng_state(checkpoint["rng"])
        if is_main and cfg.progress:
            action = "loaded the finished run" if start >= cfg.max_steps else "resuming"
            print(f"{action} from {checkpoint_path} (step {start})", flush=True)
    else:
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)

    use_amp = cfg.amp and device.type == "cuda"
    clip = cfg.grad_clip if cfg.grad_clip else math.inf
    params = [p for p in raw_model.parameters() if p.requires_grad]
    bar = None
    notebook = _in_notebook()
    if is_main and cfg.progress and not notebook and start < cfg.max_steps:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=start, file=sys.stderr, dynamic_ncols=True)
    started = time.perf_counter()

    def save(step: int) -> None:
        if checkpoint_path is not None and is_main:
            save_checkpoint(checkpoint_path, raw_model, optimizer, step, history)
        if distributed:
            dist.barrier()

    def report(record: dict[str, float]) -> None:
        if on_log is not None:
            on_log(record)
        if not cfg.progress:
            return
        if bar is not None:
            bar.write(_format(record))
        else:
            print(f"{_format(record)} | {time.perf_counter() - started:.0f}s", flush=True)

    model.train()
    for step in range(start, cfg.max_steps):
        lr = lr_at(cfg, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = get_batch(step)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
            loss = loss_fn(model, batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss is {loss.item()} at step {step}: lower lr or check the data")
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        loss_value = loss.detach()
        if distributed:
            dist.all_reduce(loss_value, op=dist.ReduceOp.AVG)
        history.step.append(step)
        history.train_loss.append(loss_value.item())
        history.lr.append(lr)
        history.grad_norm.append(grad_norm.item())
        done = step + 1
        record = None
        if is_main and cfg.log_every and (done % cfg.log_every == 0 or done == cfg.max_steps):
            window = history.train_loss[-cfg.log_every :]
            record = {"step": done, "loss": sum(window) / len(window), "lr": lr}
        if evaluate is not None and (
            (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.max_steps
        ):
            model.eval()
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_amp):
                metrics = {k: float(v) for k, v in evaluate(raw_model).items()}
            model.train()
            history.evals.append({"step": done, **metrics})
            if is_main:
                record = {**(record or {"step": done}), **metrics}
        if record is not None and is_main:
            report(record)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{history.train_loss[-1]:.3f}", lr=f"{lr:.1e}")
        if checkpoint_path is not None and (
            (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.max_steps
        ):
            save(done)
    if bar is not None:
        bar.close()
    model.eval()
    return history
