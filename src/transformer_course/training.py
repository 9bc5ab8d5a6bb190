"""The training loop shared by the translation model (chapter 5) and GPT-2 (chapter 6).

One function, `train`, runs AdamW with a learning-rate schedule, gradient clipping, periodic
evaluation, progress reporting and checkpoints. It knows nothing about the model: the caller
passes `get_batch(step)` and `loss_fn(model, batch)`.

Checkpoints hold the model, the optimizer, the step, every random number generator's state and
the history, so a run killed at any point and started again with the same arguments continues
exactly where it stopped (bit-identically on the CPU). Files are written atomically: a crash
while saving leaves the previous checkpoint intact. A step whose gradients are not finite is
never taken, and training stops with an error naming it before anything else is saved. With
`best_metric` set, the weights with the lowest value of that evaluation metric are kept too
(`best.pt`, written only when the metric improves, as nanoGPT does).

On a GPU the loop does not wait for the device within a step: losses and gradient norms stay
on the device until the next log line, and the fused AdamW skips a non-finite step by itself.

Under `torchrun` (when `torch.distributed` is initialised) the model is wrapped in
`DistributedDataParallel`; every rank calls `get_batch(step)`, which must return that rank's
own shard of the step's data; only rank 0 prints and saves.

Beside the loop, as in nanoGPT's `train.py`: `sample_batch` draws random windows of a token
stream for next-token prediction and `estimate_loss` averages the loss over a few of them.
"""

from __future__ import annotations

import math
import pickle
import random
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.files import atomic_write
from transformer_course.runtime import evaluating

Batch = Any
CHECKPOINT_NAME = "checkpoint.pt"
BEST_NAME = "best.pt"
FIELDS = ("model", "optimizer", "step", "rng", "history", "architecture")  # of a checkpoint
SCHEDULES = ("constant", "cosine", "inverse_sqrt")


@dataclass
class TrainConfig:
    """Everything `train` needs besides the model and the data.

    `lr` is the peak learning rate, reached at the end of `warmup_steps`. `lr_schedule` is one of
    `"constant"`, `"cosine"`, `"inverse_sqrt"` or a function `step -> learning rate`.
    `eval_every=0` and `checkpoint_every=0` mean never (a checkpoint is still written at the end
    when `checkpoint_dir` is set). `amp` turns on bfloat16 autocast, on CUDA only. `best_metric`
    names a metric returned by `evaluate` (lower is better): the weights where it was lowest are
    kept in `History.best_state` and, with `checkpoint_dir`, in `best.pt`.

    Course: chapter 5.
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
    best_metric: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_steps", "warmup_steps", "eval_every", "log_every", "checkpoint_every"):
            validate.integer(name, getattr(self, name), low=0)
        validate.number("lr", self.lr, low=0, low_open=True)
        validate.number("min_lr", self.min_lr, low=0)
        validate.number("weight_decay", self.weight_decay, low=0)
        if self.grad_clip is not None:
            validate.number("grad_clip", self.grad_clip, low=0)
        if len(self.betas) != 2:
            raise ValueError(f"betas: expected two numbers (beta1, beta2), got {self.betas!r}")
        for index, beta in enumerate(self.betas):
            validate.probability(f"betas[{index}]", beta)
        if not callable(self.lr_schedule) and self.lr_schedule not in SCHEDULES:
            raise ValueError(
                f"lr_schedule: expected one of {SCHEDULES} or a function, got {self.lr_schedule!r}"
            )
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ValueError(
                "checkpoint_dir: checkpoint_every is set, so a directory is needed, got None"
            )
        folder = self.checkpoint_dir
        if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"checkpoint_dir: expected a directory, got the file {folder}")
        metric = self.best_metric
        if metric is not None and not (isinstance(metric, str) and metric):
            raise ValueError(f"best_metric: expected None or the name of a metric, got {metric!r}")
        validate.flag("amp", self.amp)
        validate.flag("progress", self.progress)


@dataclass
class History:
    """What happened during training: one entry per step, plus one record per evaluation.

    Course: chapter 5.
    """

    step: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    lr: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)  # each has a "step" key
    best: dict[str, float] = field(default_factory=dict)  # {"step": s, metric: v} of the best eval
    # The weights of the best evaluation (on the CPU); not part of `to_dict`.
    best_state: dict[str, Tensor] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "best_state"}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        lists = [f.name for f in fields(cls) if f.name not in ("best", "best_state")]
        missing = [name for name in lists if name not in data]
        if missing:
            raise ValueError(f"history: expected the fields {missing}, which are missing")
        # "best" is absent from checkpoints written before it existed.
        return cls(**{name: list(data[name]) for name in lists}, best=dict(data.get("best", {})))


# Learning-rate schedules: plain functions of the step, so a notebook can plot them.


def constant_lr(step: int, *, lr: float, warmup_steps: int = 0) -> float:
    """`lr` after a linear warmup from `lr / warmup_steps`.

    Course: chapter 5.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr


def cosine_lr(
    step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr: float = 0.0
) -> float:
    """Linear warmup to `lr`, then half a cosine down to `min_lr` at `max_steps`.

    Course: chapter 6, exercise 6.10, checked by checks.gpt2.check_cosine_lr.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def inverse_sqrt_lr(step: int, *, lr: float, warmup_steps: int) -> float:
    """Vaswani et al.'s schedule: linear warmup to `lr`, then decay proportional to 1/sqrt(step).

    The paper writes it as `d_model**-0.5 * min(n**-0.5, n * warmup**-1.5)` with `n = step + 1`;
    that is this function with `lr = (d_model * warmup_steps) ** -0.5`.

    Course: chapter 5, exercise 5.8, checked by checks.translation.check_inverse_sqrt_lr.
    """
    n = step + 1
    warmup = max(1, warmup_steps)
    return lr * min(n / warmup, math.sqrt(warmup / n))


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate `cfg` asks for at `step` (counted from 0).

    Course: chapter 5.
    """
    if callable(cfg.lr_schedule):
        return float(cfg.lr_schedule(step))
    if cfg.lr_schedule == "cosine":
        return cosine_lr(
            step,
            lr=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            max_steps=cfg.max_steps,
            min_lr=cfg.min_lr,
        )
    if cfg.lr_schedule == "inverse_sqrt":
        return inverse_sqrt_lr(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps)
    return constant_lr(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps)


def _decays(name: str, param: nn.Parameter) -> bool:
    """Weight decay applies to matrices only: not to biases (`b`, `b_Q`, `bias`, ...) or norm
    gains."""
    leaf = name.rsplit(".", 1)[-1]
    return param.ndim >= 2 and not (leaf in ("b", "bias") or leaf.startswith("b_"))


def make_optimizer(
    model: nn.Module, cfg: TrainConfig, *, decays: set[str] | None = None
) -> torch.optim.AdamW:
    """AdamW with two groups: weight decay on matrices (embeddings included), none on biases and
    norms (or, with `decays`, on the parameters it names: a sharded model's are flat slices).
    Uses the fused CUDA kernel when the model lives on a GPU.

    Course: chapter 6.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decides = _decays if decays is None else lambda n, p: n in decays
    decay = [p for n, p in params if decides(n, p)]
    no_decay = [p for n, p in params if not decides(n, p)]
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
            problems.append(
                f"parameter {name}: checkpoint shape {tuple(old)}, this model {tuple(new)}"
            )
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


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    history: History,
) -> None:
    """Save everything needed to resume after `step` completed steps.

    Course: chapter 5.
    """
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "step": step,
        "rng": _rng_state(),
        "history": history.to_dict(),
        "architecture": _architecture(model),
    }
    atomic_write(path, lambda f: torch.save(checkpoint, f))


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`, refusing (with the file and the field named)
    one that is empty, truncated, not a checkpoint, or missing a field.

    Course: chapter 5.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path: no checkpoint at {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, OSError, RuntimeError, ValueError, KeyError) as error:
        if "Unsupported global" in str(error):
            raise ValueError(
                f"checkpoint {path}: holds objects other than tensors and plain data, so it was "
                "not written by this course; refusing to unpickle it"
            ) from None
        unpickling = isinstance(error, pickle.UnpicklingError | KeyError)
        reason = "not a PyTorch file" if unpickling else str(error) or "unexpected end of file"
        raise ValueError(
            f"checkpoint {path}: cannot be read ({type(error).__name__}: {reason}); it is empty, "
            f"truncated or not a checkpoint ({path.stat().st_size} bytes). Delete it to start again"
        ) from None
    if not isinstance(checkpoint, dict):
        got = type(checkpoint).__name__
        raise ValueError(f"checkpoint {path}: expected a dict of {FIELDS}, got a {got}")
    for key in FIELDS:
        if key not in checkpoint:
            raise ValueError(f"checkpoint {path}: the field {key!r} is missing (of {FIELDS})")
    step = checkpoint["step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint {path}: field 'step' must be an int >= 0, got {step!r}")
    for key in ("model", "history", "architecture"):
        if not isinstance(checkpoint[key], dict):
            got = type(checkpoint[key]).__name__
            raise ValueError(f"checkpoint {path}: field {key!r} must be a dict, got {got}")
    return checkpoint


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a checkpoint into `model` (and `optimizer`); returns the whole checkpoint dict.

    A checkpoint from a different architecture is refused with a list of what differs.

    Course: chapter 5.
    """
    checkpoint = read_checkpoint(path)
    try:
        problems = _describe_mismatch(checkpoint["architecture"], _architecture(model))
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"checkpoint {path}: field 'architecture' is malformed: {error}") from None
    if problems:
        raise ValueError(
            f"checkpoint {path} was saved from a different model; use another checkpoint_dir or "
            "the same configuration:\n  " + "\n  ".join(problems)
        )
    model.load_state_dict(checkpoint["model"])
    if optimizer is not None and checkpoint["optimizer"] is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint


# Progress reporting.


def _draw_bar() -> bool:
    """A tqdm bar only on a terminal; a notebook or a log file gets plain lines at each log step."""
    return sys.stderr.isatty() and "ipykernel" not in sys.modules


def _format(record: dict[str, float]) -> str:
    parts = [f"step {record['step']:>6d}"]
    for key, value in record.items():
        if key == "step":
            continue
        parts.append(f"{key} {value:.2e}" if key == "lr" else f"{key} {value:.4f}")
    return " | ".join(parts)


def _step_if_finite(optimizer: torch.optim.Optimizer, finite: Tensor) -> None:
    """Take the optimizer step only if `finite` (a bool tensor) is True.

    A fused optimizer skips the whole update on the device when its `found_inf` is set (the flag
    `torch.amp.GradScaler` uses), so the host never waits for the GPU; any other optimizer needs
    the answer on the host (free on the CPU).
    """
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~finite).float()
        optimizer.step()
    elif finite.item():
        optimizer.step()


def _all_finite(params: list[Tensor]) -> bool:
    return bool(torch.stack([p.detach().isfinite().all() for p in params]).all())


def _is_due(done: int, every: int, max_steps: int) -> bool:
    """Whether, after `done` steps, an action repeated every `every` steps (0: only at the end)
    is due: at each multiple of `every`, and always at the last step."""
    return done == max_steps or (every > 0 and done % every == 0)


class _Progress:
    """Log records: a tqdm bar on a terminal, plain lines in a notebook or a log file."""

    def __init__(self, cfg: TrainConfig, start: int, show: bool, on_log: Callable | None):
        self.show, self.on_log = show and cfg.progress, on_log
        self.started = time.perf_counter()
        self.bar = None
        if self.show and _draw_bar() and start < cfg.max_steps:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=cfg.max_steps, initial=start, file=sys.stderr, dynamic_ncols=True)

    def report(self, record: dict[str, float], lr: float) -> None:
        if self.on_log is not None:
            self.on_log(record)
        if not self.show:
            return
        if self.bar is not None:
            if "loss" in record:
                self.bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.1e}")
            self.bar.write(_format(record))
        else:
            print(f"{_format(record)} | {time.perf_counter() - self.started:.0f}s", flush=True)

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _resume(path: Path, best_path: Path, model: nn.Module, optimizer: torch.optim.Optimizer):
    """Load the checkpoint at `path` into `model` and `optimizer`, restore every random number
    generator, and return its step and history (with the best weights, if `best_path` holds
    the ones the history names)."""
    checkpoint = load_checkpoint(path, model, optimizer)
    try:
        history = History.from_dict(checkpoint["history"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"checkpoint {path}: field 'history' is malformed: {error}") from None
    _set_rng_state(checkpoint["rng"])
    if history.best and best_path.exists():
        best = read_checkpoint(best_path)
        if best["step"] == history.best["step"]:
            history.best_state = best["model"]
    if history.best_state is None:
        history.best = {}  # best.pt missing, or from after this checkpoint: found again later
    return checkpoint["step"], history


class _TrainingRun:
    """One call of `train`: the model (wrapped for DDP), the optimizer, the history, the files,
    and the step losses still waiting on the device."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, optimizer, on_log, parallel) -> None:
        self.cfg, self.raw_model = cfg, model
        self.distributed = dist.is_available() and dist.is_initialized()
        self.is_main = not self.distributed or dist.get_rank() == 0
        self.device = next(model.parameters()).device
        self.model = model
        decays = {n for n, p in model.named_parameters() if _decays(n, p)}  # before any sharding
        if parallel is not None:
            self.model = parallel(model)
        elif self.distributed:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(model, device_ids=ids)
        if optimizer is None:
            optimizer = make_optimizer(model, cfg, decays=decays)
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.use_amp = cfg.amp and self.device.type == "cuda"
        folder = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
        self.checkpoint_path = folder / CHECKPOINT_NAME if folder is not None else None
        self.best_path = folder / BEST_NAME if folder is not None else None
        self.start, self.history = 0, History()
        if self.checkpoint_path is not None and self.checkpoint_path.exists():
            self.start, self.history = _resume(
                self.checkpoint_path, self.best_path, model, self.optimizer
            )
            if self.is_main and cfg.progress:
                done = self.start >= cfg.max_steps
                action = "loaded the finished run" if done else "resuming"
                print(f"{action} from {self.checkpoint_path} (step {self.start})", flush=True)
        else:
            random.seed(cfg.seed)
            np.random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
        self.saved_step = self.start
        self.pending: list[tuple[int, Tensor, Tensor]] = []  # (step, loss, grad norm), on device
        self.progress = _Progress(cfg, self.start, self.is_main, on_log)

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_amp)

    def step(self, step: int, get_batch: Callable, loss_fn: Callable) -> float:
        """One optimizer step (skipped if the loss or the gradients are not finite); returns
        its learning rate. The loss and the gradient norm stay on the device, pending."""
        lr = lr_at(self.cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = get_batch(step)
        with self.autocast():
            loss = loss_fn(self.model, batch)
        loss.backward()
        finish = getattr(self.model, "finish_gradient_synchronization", None)
        if finish is not None:  # chapter 8's wrappers: the gradients are averaged now
            finish()
        clip = self.cfg.grad_clip if self.cfg.grad_clip else math.inf
        clip_grad_norm = getattr(self.model, "clip_grad_norm_", None)  # a sharded model's own
        if clip_grad_norm is not None:
            grad_norm = clip_grad_norm(clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        finite = torch.isfinite(loss.detach()) & torch.isfinite(grad_norm)
        _step_if_finite(self.optimizer, finite)
        self.optimizer.zero_grad(set_to_none=True)
        loss_value = loss.detach()
        if self.distributed:
            dist.all_reduce(loss_value, op=dist.ReduceOp.AVG)
        self.pending.append((step, loss_value, grad_norm.detach()))
        self.history.lr.append(lr)
        return lr

    def collect(self) -> None:
        """Bring the pending losses and gradient norms to the host (one synchronisation) and stop
        on the first step whose loss or gradients were not finite (that step was not taken)."""
        if not self.pending:
            return
        values = torch.stack([torch.stack(pair) for _, *pair in self.pending]).float().tolist()
        steps = [step for step, _, _ in self.pending]
        self.pending.clear()
        bad = [(s, *v) for s, v in zip(steps, values) if not all(map(math.isfinite, v))]
        if bad:
            step, loss, norm = bad[0]
            path = self.checkpoint_path
            kept = f"; {path} (step {self.saved_step}) is intact" if path else ""
            raise FloatingPointError(
                f"step {step}: loss {loss}, gradient norm {norm}: not finite, so the step was not "
                f"taken ({len(bad)} such step(s) up to step {steps[-1]}) and training "
                f"stopped{kept}. Lower lr or check the data"
            )
        self.history.step.extend(steps)
        self.history.train_loss.extend(loss for loss, _ in values)
        self.history.grad_norm.extend(norm for _, norm in values)

    def save(self, path: Path, step: int) -> None:
        """Rank 0 writes a checkpoint (never of non-finite weights); every rank waits for it."""
        if self.is_main:
            if not _all_finite(self.params):
                raise FloatingPointError(f"step {step}: weights not finite; {path} was not written")
            save_checkpoint(path, self.raw_model, self.optimizer, step, self.history)
        if self.distributed:
            dist.barrier()

    def evaluate(self, evaluate: Callable, done: int) -> dict[str, float]:
        """Run `evaluate` in eval mode without gradients, record its metrics and keep the best."""
        self.collect()
        with evaluating(self.model), self.autocast():
            metrics = {k: float(v) for k, v in evaluate(self.raw_model).items()}
        self.history.evals.append({"step": done, **metrics})
        name = self.cfg.best_metric
        if name is not None:
            if name not in metrics:
                got = sorted(metrics)
                raise ValueError(f"best_metric: {name!r} is not among evaluate's metrics {got}")
            value, best = metrics[name], self.history.best
            if math.isfinite(value) and (not best or value < best[name]):
                self.history.best = {"step": done, name: value}
                state = self.raw_model.state_dict()
                self.history.best_state = {k: v.detach().cpu().clone() for k, v in state.items()}
                if self.best_path is not None:
                    self.save(self.best_path, done)
        return metrics

    def after_step(self, done: int, lr: float, evaluate: Callable | None) -> None:
        """What is due after `done` steps: the log line, the evaluation, the checkpoint."""
        cfg, record = self.cfg, None
        if cfg.log_every and _is_due(done, cfg.log_every, cfg.max_steps):
            self.collect()  # on every rank: all stop together on a non-finite step
            window = self.history.train_loss[-cfg.log_every :]
            record = {"step": done, "loss": sum(window) / len(window), "lr": lr}
        if evaluate is not None and _is_due(done, cfg.eval_every, cfg.max_steps):
            metrics = self.evaluate(evaluate, done)
            record = {**(record or {"step": done}), **metrics}
        if record is not None and self.is_main:
            self.progress.report(record, lr)
        self.progress.advance()
        due = _is_due(done, cfg.checkpoint_every, cfg.max_steps)
        if self.checkpoint_path is not None and due:
            self.collect()
            self.save(self.checkpoint_path, done)
            self.saved_step = done


@contextmanager
def compiled_blocks(blocks: Iterable[nn.Module], **options: Any) -> Iterator[None]:
    """Run `blocks` compiled (by `torch.compile`, with `options`) inside the `with` body, and
    eagerly again after it: for training on a GPU.

    Regional compilation: the blocks of one class share one compiled graph, so compiling costs
    the same for 6 layers as for 1, and each block's hundreds of small kernels (layer norms,
    dropouts, biases, residual sums) become a few fused ones. Lengths are dynamic, so batches of
    new lengths need no new graphs. Outside the body nothing is compiled: decoding with a cache,
    or sampling one token at a time, would compile a graph for each new length.

    Course: chapter 5.
    """
    if not isinstance(blocks, Iterable):  # a whole model, say
        got = type(blocks).__name__
        raise TypeError(f"blocks: expected the blocks (e.g. model.blocks), got {got}")
    blocks = list(blocks)
    for block in blocks:
        if not isinstance(block, nn.Module):
            raise TypeError(f"blocks: expected nn.Modules, got {type(block).__name__}")
    own = [vars(block).get("forward") for block in blocks]  # None: the class's forward
    try:
        for block in blocks:  # an instance attribute hides the class's forward
            block.forward = torch.compile(block.forward, dynamic=True, **options)
        yield
    finally:
        for block, forward in zip(blocks, own):
            if forward is None:
                vars(block).pop("forward", None)
            else:
                block.forward = forward


def train(
    model: nn.Module,
    cfg: TrainConfig,
    get_batch: Callable[[int], Batch],
    loss_fn: Callable[[nn.Module, Batch], Tensor],
    *,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    on_log: Callable[[dict[str, float]], None] | None = None,
    parallel: Callable[[nn.Module], nn.Module] | None = None,
) -> History:
    """Train `model` for `cfg.max_steps` steps and return its `History`.

    `get_batch(step)` returns the batch for a step (on the model's device). It should depend only
    on `step` (seed a generator with it) so a resumed run sees the same data; under DDP it must
    return this rank's shard. `loss_fn(model, batch)` returns a scalar loss. `evaluate(model)`,
    called every `cfg.eval_every` steps and at the end in eval mode without gradients, returns
    metrics such as `{"valid_loss": ...}`. `on_log(record)` receives each logged record.
    Under torchrun the model trains in PyTorch's `DistributedDataParallel`, or in what
    `parallel(model)` wraps it in (chapter 8's wrappers): the wrapper's
    `finish_gradient_synchronization()` runs after each backward, and its `clip_grad_norm_`, if
    it has one, clips.

    If `cfg.checkpoint_dir` holds a checkpoint, training resumes from it. The model ends with the
    weights of the last step; with `cfg.best_metric`, `History.best` says which evaluation was
    best and `History.best_state` holds its weights.

    Course: chapter 5.
    """
    if cfg.best_metric is not None and evaluate is None:
        raise ValueError(f"evaluate: best_metric={cfg.best_metric!r} needs a function, got None")
    run = _TrainingRun(model, cfg, optimizer, on_log, parallel)
    run.model.train()
    for step in range(run.start, cfg.max_steps):
        lr = run.step(step, get_batch, loss_fn)
        run.after_step(step + 1, lr, evaluate)
    run.collect()
    run.progress.close()
    run.model.eval()
    return run.history


# Next-token prediction: the loss, random windows of a token stream, the loss over a few of them.


def lm_loss(
    logits: Float[Tensor, "batch pos d_vocab"], targets: Int[Tensor, "batch pos"]
) -> Float[Tensor, ""]:
    """Mean cross-entropy of the next-token predictions (`targets` are the inputs shifted by one).

    Course: chapter 6.
    """
    validate.targets(targets, logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def sample_batch(
    data: Int[Tensor, " n_tokens"],
    batch_size: int,
    n_ctx: int,
    *,
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """`batch_size` random windows of `n_ctx` tokens from `data`, and the same windows
    shifted by one token: the inputs and the targets of next-token prediction.

    Every window whose targets fit in `data` can be drawn, each with the same probability;
    `generator` makes the draw repeatable.

    Course: chapter 6, exercise 6.8, checked by checks.gpt2.check_sample_batch.
    """
    validate.positive_int("batch_size", batch_size)
    validate.positive_int("n_ctx", n_ctx)
    validate.token_stream("data", data, n_ctx)
    starts = torch.randint(len(data) - n_ctx, (batch_size,), generator=generator)
    offsets = torch.arange(n_ctx)
    x = data[starts[:, None] + offsets]
    y = data[starts[:, None] + offsets + 1]
    return x, y


def estimate_loss(
    model: nn.Module,
    data: Int[Tensor, " n_tokens"],
    *,
    batch_size: int,
    n_ctx: int,
    n_batches: int,
    generator: torch.Generator | None = None,
) -> float:
    """Mean next-token loss over `n_batches` random batches of `data` (nanoGPT's
    `estimate_loss`), in eval mode without gradients.

    Course: chapter 6, exercise 6.9, checked by checks.gpt2.check_estimate_loss.
    """
    validate.positive_int("n_batches", n_batches)
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    with evaluating(model):
        for _ in range(n_batches):
            x, y = sample_batch(data, batch_size, n_ctx, generator=generator)
            total += lm_loss(model(x.to(device)), y.to(device))
    return total.item() / n_batches  # one host synchronisation, not one per batch
