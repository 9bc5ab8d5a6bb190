"""Policy gradients from a verifiable reward: GRPO (Shao et al., 2024) and its simpler kin.

For each prompt the policy samples a group of `group_size` responses; each gets a reward. GRPO's
advantage of a response is its reward minus its group's mean (divided by the group's std, or
not: Dr. GRPO drops it), so no value model is needed. The loss, per token of the response,
pushes up the log-prob of responses that did better than their siblings. With several steps
on one batch of rollouts the policy drifts from the one that sampled them, so GRPO weighs each
token by the ratio `pi / pi_old` and clips it to `[1 - eps, 1 + eps]`, as PPO does.
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from transformer_course import validate

__all__ = ["group_normalized_rewards", "policy_gradient_loss", "POLICY_GRADIENT_KINDS"]

POLICY_GRADIENT_KINDS = {  # each kind: the arguments it needs
    "no_baseline": ("rewards",),
    "reinforce_with_baseline": ("advantages",),
    "grpo_clip": ("advantages", "old_log_probs", "clip_range"),
}


def group_normalized_rewards(
    rewards: Float[Tensor, " rollouts"],
    group_size: int,
    *,
    eps: float = 1e-6,
    normalize_by_std: bool = True,
) -> tuple[Float[Tensor, " rollouts"], Float[Tensor, " rollouts"]]:
    """`(advantages, raw_rewards)`: each reward minus its group's mean, divided by the group's
    std (unbiased, as `torch.std`) plus `eps` with `normalize_by_std`. Groups are consecutive:
    rollouts `[g * group_size, (g + 1) * group_size)` answer prompt `g`.

    Course: chapter 9, exercise 9.9, checked by checks.assistant.check_group_normalized_rewards.
    """
    if not isinstance(rewards, Tensor) or rewards.ndim != 1 or not rewards.is_floating_point():
        got = tuple(rewards.shape) if isinstance(rewards, Tensor) else type(rewards).__name__
        raise ValueError(f"rewards: expected a 1-d float tensor (rollouts,), got {got}")
    validate.positive_int("group_size", group_size)
    validate.divisor("group_size", group_size, "len(rewards)", len(rewards))
    validate.number("eps", eps, low=0)
    if validate.flag("normalize_by_std", normalize_by_std) and group_size < 2:
        raise ValueError(f"group_size: expected >= 2 to divide by a group's std, got {group_size}")
    groups = rewards.view(-1, group_size)
    advantages = groups - groups.mean(dim=-1, keepdim=True)
    if normalize_by_std:
        advantages = advantages / (groups.std(dim=-1, keepdim=True) + eps)
    return advantages.flatten(), rewards


def _per_row(name: str, value: Any, log_probs: Tensor) -> Tensor:
    """A reward or advantage per row of `log_probs`, `(batch,)` or `(batch, 1)`, as `(batch, 1)`."""
    batch = log_probs.shape[0]
    if not isinstance(value, Tensor) or value.shape not in ((batch,), (batch, 1)):
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name}: expected shape ({batch},) or ({batch}, 1), got {got}")
    return value.reshape(batch, 1).to(log_probs.dtype)


def policy_gradient_loss(
    log_probs: Float[Tensor, "batch seq"],
    *,
    kind: str,
    rewards: Tensor | None = None,
    advantages: Tensor | None = None,
    old_log_probs: Tensor | None = None,
    clip_range: float | None = None,
) -> Float[Tensor, "batch seq"]:
    """The per-token policy-gradient loss (reduce it with `masked_mean` over the response).

    - `"no_baseline"`: `-rewards * log_probs` (REINFORCE with the raw reward of each row);
    - `"reinforce_with_baseline"`: `-advantages * log_probs`;
    - `"grpo_clip"`: `-min(ratio * A, clip(ratio, 1 - clip_range, 1 + clip_range) * A)` with
      `ratio = exp(log_probs - old_log_probs)`; `old_log_probs` (the sampling policy's, no
      gradient) has the shape of `log_probs`, `clip_range` is in (0, 1).

    Each kind takes exactly the arguments it names; rewards and advantages are per row.

    Course: chapter 9, exercise 9.10, checked by checks.assistant.check_policy_gradient_loss.
    """
    validate.one_of("kind", kind, POLICY_GRADIENT_KINDS)
    given = dict(rewards=rewards, advantages=advantages, old_log_probs=old_log_probs)
    given["clip_range"] = clip_range
    needed = POLICY_GRADIENT_KINDS[kind]
    for name, value in given.items():
        if (value is None) == (name in needed):
            wanted = "needs" if name in needed else "takes no"
            raise ValueError(f"{name}: kind={kind!r} {wanted} {name}, got {value!r}")
    if not isinstance(log_probs, Tensor) or log_probs.ndim != 2:
        got = tuple(log_probs.shape) if isinstance(log_probs, Tensor) else type(log_probs)
        raise ValueError(f"log_probs: expected a float tensor (batch, seq), got {got}")
    if kind == "no_baseline":
        return -_per_row("rewards", rewards, log_probs) * log_probs
    advantages = _per_row("advantages", advantages, log_probs)
    if kind == "reinforce_with_baseline":
        return -advantages * log_probs
    if not isinstance(old_log_probs, Tensor) or old_log_probs.shape != log_probs.shape:
        got = tuple(old_log_probs.shape) if isinstance(old_log_probs, Tensor) else "?"
        raise ValueError(
            f"old_log_probs: expected the shape of log_probs {tuple(log_probs.shape)}, got {got}"
        )
    eps = validate.number("clip_range", clip_range, low=0, high=1, low_open=True)
    if eps >= 1:
        raise ValueError(f"clip_range: expected a number in (0, 1), got {clip_range!r}")
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = ratio.clamp(1 - eps, 1 + eps)
    return -torch.minimum(ratio * advantages, clipped * advantages)
