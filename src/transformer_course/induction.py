"""Induction heads forming: train an attention-only transformer where copying pays, and watch.

Each training sequence is a random segment of tokens repeated over and over, with a period
that varies from row to row. The first occurrence cannot be predicted better than chance
(ln d_vocab nats per token); the repeats can be predicted perfectly by a model that looks back
for the previous occurrence of the current token and copies the token that followed it: an
induction head (Olsson et al., 2022), which needs two layers (a previous-token head feeding the
induction head's keys). Held-out sequences are a random segment written twice.

`train_induction` logs, over training steps, the loss on each repeat (their difference is the
in-context loss: late tokens against early ones) and every head's induction score.
`phase_change_step` finds the step where the in-context loss drops and the induction score
rises together: the phase change. Without layer norms, start the weights larger than GPT-2's
0.02 (`init_range=0.1` at `d_model=64`): with small weights and no norm the attention scores
start near zero and hardly move, and the run stays on its plateau for thousands of steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from jaxtyping import Float, Int
from torch import Tensor

from transformer_course import validate
from transformer_course.attention import set_fast_path
from transformer_course.attention_only import AttentionOnlyTransformer
from transformer_course.head_detectors import (
    induction_scores,
    per_token_loss,
    repeat_losses,
    repeated_tokens,
)
from transformer_course.runtime import evaluating
from transformer_course.training import lm_loss

__all__ = [
    "copying_batch",
    "InductionRun",
    "train_induction",
    "phase_change_step",
]


def copying_batch(
    batch: int, n_ctx: int, d_vocab: int, *, generator: torch.Generator | None = None
) -> Int[Tensor, "batch n_ctx"]:
    """Training text where copying pays: each row a random segment repeated over and over,
    with its own length from `n_ctx // 4` to `n_ctx // 2` (at least 2). The distance between
    repeats varies from row to row, so no head can predict them from positions alone: the
    model has to find the earlier occurrence of the current token and copy what followed it.

    Course: chapter 10.
    """
    validate.positive_int("batch", batch)
    validate.integer("n_ctx", n_ctx, low=4)
    validate.positive_int("d_vocab", d_vocab)
    periods = torch.randint(max(2, n_ctx // 4), n_ctx // 2 + 1, (batch, 1), generator=generator)
    segments = torch.randint(0, d_vocab, (batch, n_ctx // 2), generator=generator)
    index = torch.arange(n_ctx) % periods  # (batch, n_ctx): position i copies i mod period
    return segments.gather(1, index)


@dataclass
class InductionRun:
    """What `train_induction` logged: at each evaluated step, the loss on the first and on the
    second repeat of held-out sequences and every head's induction score `(layer, head)`."""

    steps: list[int] = field(default_factory=list)
    first_loss: list[float] = field(default_factory=list)
    second_loss: list[float] = field(default_factory=list)
    induction: list[Tensor] = field(default_factory=list)

    @property
    def in_context_loss(self) -> list[float]:
        """Second-repeat loss minus first-repeat loss (negative once the model copies)."""
        return [b - a for a, b in zip(self.first_loss, self.second_loss)]

    @property
    def scores(self) -> Float[Tensor, "evals layer head"]:
        """Every logged induction score, one `(layer, head)` table per evaluated step."""
        return torch.stack(self.induction)


def train_induction(
    model: AttentionOnlyTransformer,
    *,
    steps: int,
    batch_size: int = 64,
    lr: float = 1e-2,
    eval_every: int = 10,
    seed: int = 0,
    warmup_steps: int = 0,
    weight_decay: float = 0.01,
) -> InductionRun:
    """Train `model` with AdamW on `copying_batch` sequences, logging (before the first step,
    every `eval_every` steps and after the last) the repeat losses and every head's induction
    score on one fixed held-out batch: 64 random segments of `n_ctx // 2` tokens written twice.
    The learning rate rises linearly to `lr` over the first `warmup_steps` steps.

    Course: chapter 10.
    """
    validate.positive_int("steps", steps)
    validate.positive_int("eval_every", eval_every)
    validate.integer("warmup_steps", warmup_steps, low=0)
    validate.number("weight_decay", weight_decay, low=0)
    cfg = model.cfg
    seg_len = cfg.n_ctx // 2
    generator = torch.Generator().manual_seed(seed)
    device = model.embed.W_E.device
    held_out = repeated_tokens(64, seg_len, cfg.d_vocab, seed=seed + 1).to(device)
    names = [f"blocks.{layer}.attn.hook_pattern" for layer in range(cfg.n_layers)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps))
    )
    run = InductionRun()

    def log(step: int) -> None:
        with evaluating(set_fast_path(model, False)):  # the einsum path: patterns are hooked
            logits, cache = model.run_with_cache(held_out, names_filter=names)
        set_fast_path(model, True)  # train with PyTorch's fused attention
        first, second = repeat_losses(per_token_loss(logits, held_out), seg_len)
        run.steps.append(step)
        run.first_loss.append(first.mean().item())
        run.second_loss.append(second.mean().item())
        run.induction.append(
            torch.stack([induction_scores(cache[name], seg_len) for name in names]).cpu()
        )

    log(0)
    model.train()
    for step in range(1, steps + 1):
        tokens = copying_batch(batch_size, cfg.n_ctx + 1, cfg.d_vocab, generator=generator)
        tokens = tokens.to(device)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        warmup.step()
        if step % eval_every == 0 or step == steps:
            log(step)
    set_fast_path(model, False)
    return run


def phase_change_step(
    run: InductionRun, *, window: int, min_drop: float = 1.0, min_rise: float = 0.3
) -> int | None:
    """The step of the phase change, or None if there is none.

    The loss drop is the first logged step where the second-repeat loss has fallen half-way
    from its highest value to its last; the score rise, the first step where the best head's
    induction score has risen half-way from its first value to its last. They are a phase
    change if the loss fell by at least `min_drop` nats, the score rose by at least
    `min_rise`, and the two steps lie within `window` steps of each other; the step returned
    is the loss drop's.

    Course: chapter 10.
    """
    validate.integer("window", window, low=0)
    loss = torch.tensor(run.second_loss)
    score = run.scores.flatten(1).amax(dim=1)
    peak = int(loss.argmax())
    drop, rise = loss[peak] - loss[-1], score[-1] - score[0]
    if drop < min_drop or rise < min_rise:
        return None
    steps = torch.tensor(run.steps)
    after = torch.arange(len(loss)) >= peak
    loss_step = steps[after & (loss <= loss[peak] - drop / 2)][0]
    score_step = steps[score >= score[0] + rise / 2][0]
    if abs(int(loss_step) - int(score_step)) > window:
        return None
    return int(loss_step)
