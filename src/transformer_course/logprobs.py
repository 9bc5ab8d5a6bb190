"""What fine-tuning reads from a model: the log-probability of each token it was shown, the
entropy of each next-token distribution, and sums and means over the response tokens only.

Everything is computed in float32 whatever the model's dtype: a bfloat16 log-softmax keeps 8
bits, and a sequence's log-probability sums many of them. A row whose mask is empty (a
response cut to nothing) gives 0, never a NaN that would poison a whole batch's loss.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from transformer_course import validate

__all__ = ["response_log_probs", "token_entropy", "masked_mean", "masked_normalize"]


def response_log_probs(
    model: Any, input_ids: Int[Tensor, "batch seq"], labels: Int[Tensor, "batch seq"]
) -> Float[Tensor, "batch seq"]:
    """`log p(labels[b, t] | input_ids[b, :t+1])` under `model` (tokens -> logits), float32.

    The log-softmax is taken in float32 and the label's entry gathered from it; sum it under a
    response mask for a sequence's log-probability.

    Course: chapter 9, exercise 9.2, checked by checks.assistant.check_response_log_probs.
    """
    for name, ids in (("input_ids", input_ids), ("labels", labels)):
        validate.integer_tensor(name, ids, ("batch", "seq"))
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"labels: expected the shape of input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(labels.shape)}"
        )
    log_probs = model(input_ids).float().log_softmax(dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: Float[Tensor, "batch seq d_vocab"]) -> Float[Tensor, "batch seq"]:
    """The entropy of each next-token distribution, in nats, float32.

    `H = -sum_v p_v log p_v` with `log p_v = x_v - logsumexp(x)` (`log_softmax`), never the log
    of a probability that underflowed to 0 (a token that cannot come, a logit of -inf, adds 0).

    Course: chapter 9, exercise 9.3, checked by checks.assistant.check_token_entropy.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.ndim < 1:
        raise ValueError(f"logits: expected a floating-point tensor (..., d_vocab), got {logits!r}")
    log_probs = logits.float().log_softmax(dim=-1)
    return -(log_probs.exp() * log_probs.clamp(min=torch.finfo(torch.float32).min)).sum(dim=-1)


def _masked(x: Any, mask: Any) -> Tensor:
    """`x` with 0 where `mask` (bool or 0/1, the shape of `x`) is off: a NaN or -inf there
    (the log-prob of a padding token, say) cannot leak into a sum."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise ValueError(f"x: expected a floating-point tensor, got {x!r}")
    if not isinstance(mask, Tensor) or mask.shape != x.shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"mask: expected the shape of x {tuple(x.shape)}, got {got}")
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_mean(
    x: Float[Tensor, "*shape"], mask: Tensor, dim: int | None = None
) -> Float[Tensor, "*reduced"]:
    """The mean of `x` over the entries where `mask` is on (along `dim`, or all of them with
    None); where no entry is on, 0.

    Course: chapter 9, exercise 9.4, checked by checks.assistant.check_masked_mean.
    """
    total = _masked(x, mask).sum(dim=dim)
    count = mask.to(x.dtype).sum(dim=dim)
    return total / count.clamp(min=1)  # an empty row sums to 0: 0 / 1, and its gradient 0


def masked_normalize(
    x: Float[Tensor, "*shape"],
    mask: Tensor,
    dim: int | None = None,
    normalize_constant: float = 1.0,
) -> Float[Tensor, "*reduced"]:
    """The sum of `x` where `mask` is on (along `dim`, or all with None), divided by
    `normalize_constant`: a loss that does not depend on how many response tokens a batch has
    (Dr. GRPO's fixed constant, say).

    Course: chapter 9, exercise 9.5, checked by checks.assistant.check_masked_normalize.
    """
    constant = validate.number("normalize_constant", normalize_constant, low=0, low_open=True)
    return _masked(x, mask).sum(dim=dim) / constant
