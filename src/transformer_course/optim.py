"""The training step's three library calls, written by hand: AdamW, gradient clipping and the
cross-entropy loss. Each equals its PyTorch counterpart (`torch.optim.AdamW`,
`torch.nn.utils.clip_grad_norm_`, `torch.nn.functional.cross_entropy`) to rounding, so a
training loop can swap one for the other.

- `AdamW` (Loshchilov & Hutter, 2019) is Adam (Kingma & Ba, 2015) with decoupled weight decay:
  the weights shrink by `lr * weight_decay` directly, not through the gradient, so the decay is
  not rescaled by Adam's per-parameter step sizes.
- `clip_grad_norm` scales every gradient by one factor so that their global L2 norm is at most
  `max_norm`, keeping the direction of the update.
- `cross_entropy` computes log-softmax with the log-sum-exp trick, in float32 for
  half-precision logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from jaxtyping import Float, Int
from torch import Tensor

from transformer_course import validate
from transformer_course.runtime import upcast

__all__ = ["AdamW", "clip_grad_norm", "cross_entropy"]


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay, as `torch.optim.AdamW` (its defaults too).

    For each parameter `p` with gradient `g`, at step `t` (from 1):

        p <- p - lr * weight_decay * p                  (decoupled weight decay)
        m <- beta1 * m + (1 - beta1) * g                (running mean of the gradient)
        v <- beta2 * v + (1 - beta2) * g^2              (running mean of its square)
        p <- p - lr * m_hat / (sqrt(v_hat) + eps)       m_hat = m / (1 - beta1^t),
                                                        v_hat = v / (1 - beta2^t)

    The bias corrections undo the pull towards 0 of `m` and `v`, which start at 0. Like every
    `torch.optim.Optimizer`, it takes parameter groups with their own `lr`, `weight_decay`, ...
    (a training loop sets `group["lr"]` each step, e.g. from `training.cosine_lr`), and saves
    and loads its state with `state_dict` / `load_state_dict`.

    Course: chapter 7, exercise 7.11, checked by checks.llama.check_adamw.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        _check_settings(defaults)
        super().__init__(params, {**defaults, "betas": tuple(betas)})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Update every parameter that has a gradient; `closure` (optional) recomputes the loss
        and returns it, as for any `torch.optim.Optimizer`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):  # all of them before any update
            _check_settings(group, f"param_groups[{index}]")
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(param, group)
        return loss

    def _update(self, param: Tensor, group: dict) -> None:
        """One AdamW step of one parameter, in place."""
        lr, eps, (beta1, beta2) = group["lr"], group["eps"], group["betas"]
        state = self.state[param]
        if not state:  # first step: both running means start at zero
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["step"] += 1
        t, m, v, grad = state["step"], state["exp_avg"], state["exp_avg_sq"], param.grad
        param.mul_(1 - lr * group["weight_decay"])
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        param.addcdiv_(m_hat, v_hat.sqrt().add_(eps), value=-lr)


def _check_settings(group: dict, where: str = "") -> None:
    """AdamW's settings (`lr`, `betas`, `eps`, `weight_decay` of the defaults or of a group
    `where`) and the parameters it can update: real, not float16, with dense gradients."""
    name = lambda key: f"{where}[{key!r}]" if where else key
    validate.number(name("lr"), group["lr"], low=0)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name('betas')}: expected two numbers (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        validate.probability(f"{name('betas')}[{index}]", beta)
    validate.number(name("eps"), group["eps"], low=0, low_open=True)
    validate.number(name("weight_decay"), group["weight_decay"], low=0)
    for param in group.get("params", ()):
        sparse = param.grad is not None and param.grad.is_sparse
        if param.is_complex() or param.dtype == torch.float16 or sparse:
            got = f"{param.dtype} with a sparse gradient" if sparse else f"{param.dtype}"
            raise ValueError(
                f"{where}['params']: expected real, non-float16 parameters with dense gradients "
                f"(in float16 eps=1e-8 rounds to 0: keep float32 weights, use autocast), got {got}"
            )


def clip_grad_norm(parameters: Tensor | Iterable[Tensor], max_norm: float) -> Float[Tensor, ""]:
    """Scale the gradients of `parameters` in place so that their global L2 norm (the norm of
    all of them as one long vector) is at most `max_norm`; return that norm before clipping.

    Every gradient is multiplied by the same factor `max_norm / (norm + 1e-6)`, capped at 1,
    as `torch.nn.utils.clip_grad_norm_` does: the update keeps its direction. Parameters
    without a gradient are skipped (no gradient at all: the norm is 0); `max_norm=inf` only
    measures. A non-finite norm is returned as it is, the gradients left untouched, so a
    training loop can skip that step.

    Course: chapter 7, exercise 7.10, checked by checks.llama.check_clip_grad_norm.
    """
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    validate.tensors("parameters", params)
    validate.number("max_norm", max_norm, low=0, finite=False)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    norms = torch.stack([torch.linalg.vector_norm(g).to(device) for g in grads])
    total = torch.linalg.vector_norm(norms)  # sqrt of the sum of every squared entry
    factor = (max_norm / (total + 1e-6)).clamp(max=1.0).where(total.isfinite(), 1.0)
    for grad in grads:
        grad.mul_(factor.to(grad.device, grad.dtype))
    return total


def cross_entropy(
    logits: Float[Tensor, "*batch d_vocab"], targets: Int[Tensor, "*batch"]
) -> Float[Tensor, ""]:
    """Mean over every position of `-log softmax(logits)[target]`: `logits` `(..., d_vocab)`,
    `targets` `(...)` integer ids in [0, d_vocab).

    `-log softmax(x)[t] = log(sum_j exp(x_j)) - x_t`, and `exp` overflows for logits past 88 in
    float32 (past 11 in float16), so the largest logit `m` of each row is subtracted first:
    `log(sum_j exp(x_j - m)) - (x_t - m)`, where every exponent is at most 0 and one is 0 (the
    log-sum-exp trick). The shift is a constant, with no gradient. float16 and bfloat16 logits
    are computed in float32, and so is the loss returned; other dtypes keep theirs.

    Course: chapter 7, exercise 7.9, checked by checks.llama.check_cross_entropy.
    """
    if not isinstance(logits, Tensor) or not logits.numel() or not logits.is_floating_point():
        got = type(logits).__name__
        if isinstance(logits, Tensor):
            got = f"a {logits.dtype} tensor of shape {tuple(logits.shape)}"
        raise ValueError(
            f"logits: expected a non-empty floating-point tensor (..., d_vocab), got {got}"
        )
    validate.targets(targets, logits)
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected an integer dtype (token ids), got {targets.dtype}")
    d_vocab = logits.shape[-1]
    if targets.numel() and not torch.compiler.is_compiling():
        low, high = torch.stack(torch.aminmax(targets)).tolist()
        if low < 0 or high >= d_vocab:
            raise ValueError(
                f"targets: expected ids in [0, d_vocab={d_vocab}), got ids from {low} to {high}"
            )
    shifted = upcast(logits) - upcast(logits).amax(dim=-1, keepdim=True).detach()
    log_sum_exp = shifted.exp().sum(dim=-1).log()
    target_logits = shifted.gather(-1, targets.long()[..., None])[..., 0]
    return (log_sum_exp - target_logits).mean()
