"""Direct preference optimisation (Rafailov et al., 2023): learn from pairs of responses, one
chosen over the other, without a reward model or sampling.

The policy's implicit reward of a response is `beta * (log pi(y|x) - log pi_ref(y|x))`: how
much more likely the policy makes it than the frozen reference (the SFT model) does. The loss
is the logistic loss of the chosen response's reward beating the rejected one's:
`-log sigmoid(beta * ((pc - rc) - (pr - rr)))`. A small `beta` lets the policy move far from
the reference; a large one holds it close.
"""

from __future__ import annotations

import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor

from transformer_course import validate

__all__ = ["dpo_loss", "implicit_reward"]

NAMES = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps")


def _sequence_logps(tensors: tuple) -> None:
    """Four float tensors of one shape `(batch,)`: one sequence log-prob per pair."""
    for name, t in zip(NAMES, tensors):
        if not isinstance(t, Tensor) or not t.is_floating_point() or t.ndim != 1:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a float tensor of shape (batch,), got {got}")
        if t.shape != tensors[0].shape:
            raise ValueError(
                f"{name}: expected the shape of {NAMES[0]} {tuple(tensors[0].shape)}, "
                f"got {tuple(t.shape)}"
            )


def dpo_loss(
    policy_chosen_logps: Float[Tensor, " batch"],
    policy_rejected_logps: Float[Tensor, " batch"],
    ref_chosen_logps: Float[Tensor, " batch"],
    ref_rejected_logps: Float[Tensor, " batch"],
    beta: float,
) -> Float[Tensor, ""]:
    """The mean DPO loss over a batch of pairs, from sequence log-probs (the response tokens'
    log-probs summed) under the policy and the frozen reference. `beta > 0`. The implicit
    rewards whose margin it widens are `implicit_reward(policy, ref, beta)`.

    Course: chapter 9.
    """
    logps = (policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    _sequence_logps(logps)
    beta = validate.number("beta", beta, low=0, low_open=True)
    chosen = policy_chosen_logps - ref_chosen_logps
    rejected = policy_rejected_logps - ref_rejected_logps
    return -F.logsigmoid(beta * (chosen - rejected)).mean()


def implicit_reward(
    policy_logps: Float[Tensor, " batch"], ref_logps: Float[Tensor, " batch"], beta: float
) -> Float[Tensor, " batch"]:
    """DPO's implicit reward of each response, `beta * (policy - ref)`, without gradient: what
    a page plots for the chosen and rejected responses (their difference is the margin).

    Course: chapter 9.
    """
    beta = validate.number("beta", beta, low=0, low_open=True)
    if policy_logps.shape != ref_logps.shape:
        raise ValueError(
            f"ref_logps: expected the shape of policy_logps {tuple(policy_logps.shape)}, "
            f"got {tuple(ref_logps.shape)}"
        )
    return beta * (policy_logps - ref_logps).detach()
