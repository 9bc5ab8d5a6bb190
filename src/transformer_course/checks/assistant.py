"""Checkers for chapter 9's components: the masked mean (an empty row gives 0), the DPO loss,
group-normalised advantages and the policy-gradient losses, each against the reference with the
bug catalogue's mistakes named."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformer_course import dpo, logprobs, policy_gradient
from transformer_course.checks.harness import call, expect, expect_close, passed, randn

MASK = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
EMPTY_HINT = "a row with an empty mask gives 0, not 0 / 0 = NaN: divide by the count clamped to 1."


def check_masked_mean(fn: Callable) -> None:
    """`masked_mean(x, mask, dim)` against the reference, an empty row included: 1e-12."""
    x = randn(3, 5, seed=1)
    for dim in (None, 0, 1):
        where = f"masked_mean(x (3, 5), mask, dim={dim})"
        hint = "sum x where the mask is on, divided by how many entries are on."
        wanted = logprobs.masked_mean(x, MASK, dim)
        got = call(where, fn, x, MASK, dim)
        if dim == 1 and isinstance(got, torch.Tensor):
            expect(not got.isnan().any(), where, "the result contains NaN.", EMPTY_HINT)
        expect_close(got, wanted, where, hint, atol=1e-12, rtol=0)
    passed("masked_mean")


NO_REFERENCE = "the reference model's log-probs are missing: the reward is beta * (policy - "
NO_REFERENCE += "reference)."
BETA_OUTSIDE = "beta on the wrong side: it multiplies the margin inside the sigmoid, not the loss."
DPO_MISTAKES = {
    NO_REFERENCE: lambda pc, pr, rc, rr, beta: -F.logsigmoid(beta * (pc - pr)).mean(),
    BETA_OUTSIDE: lambda pc, pr, rc, rr, beta: -beta * F.logsigmoid((pc - rc) - (pr - rr)).mean(),
}


def check_dpo_loss(fn: Callable) -> None:
    """`dpo_loss(pc, pr, rc, rr, beta)` against the paper's formula: 1e-10 in float64."""
    pc, pr, rc, rr = (-10 * randn(6, seed=s).abs() for s in range(4))
    for beta in (0.1, 2.0):
        where = f"dpo_loss(4 tensors (6,), beta={beta})"
        wrong = {h: f(pc, pr, rc, rr, beta) for h, f in DPO_MISTAKES.items()}
        hint = "-log sigmoid(beta * ((pc - rc) - (pr - rr))), averaged over the pairs."
        got = call(where, fn, pc, pr, rc, rr, beta)
        wanted = dpo.dpo_loss(pc, pr, rc, rr, beta)
        expect_close(got, wanted, where, hint, atol=1e-10, rtol=0, mistakes=wrong)
    passed("dpo_loss")


REWARDS = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 2.0], dtype=torch.float64)


def _batch_normalized(rewards, group_size, *, eps=1e-6, normalize_by_std=True):
    advantages = rewards - rewards.mean()
    return (advantages / (rewards.std() + eps) if normalize_by_std else advantages), rewards


def check_group_normalized_rewards(fn: Callable) -> None:
    """`group_normalized_rewards` with and without the std, against the reference: 1e-12."""
    for by_std in (True, False):
        where = f"group_normalized_rewards(8 rewards, 4, normalize_by_std={by_std})"
        got = call(where, fn, REWARDS, 4, eps=1e-6, normalize_by_std=by_std)
        expect(isinstance(got, tuple) and len(got) == 2, where, "expected (advantages, raw).")
        wanted = policy_gradient.group_normalized_rewards(REWARDS, 4, normalize_by_std=by_std)
        batch = _batch_normalized(REWARDS, 4, normalize_by_std=by_std)[0]
        wrong = {
            "normalised over the whole batch: each group of group_size rollouts has its "
            "own mean and std (view(-1, group_size)).": batch
        }
        hint = "per group: (r - mean) / (std + eps), std unbiased as torch.std."
        expect_close(got[0], wanted[0], where, hint, atol=1e-12, rtol=0, mistakes=wrong)
    passed("group_normalized_rewards")


def check_policy_gradient_loss(fn: Callable) -> None:
    """The three kinds against the reference, and GRPO's gradient (the ratio must carry it,
    the clipped surrogate take the min): 1e-12 in float64."""
    logp = -randn(4, 5, seed=5).abs()
    old = logp + 0.4 * randn(4, 5, seed=6)
    adv = randn(4, 1, seed=7)
    for kind, kwargs in (
        ("no_baseline", dict(rewards=adv)),
        ("reinforce_with_baseline", dict(advantages=adv)),
        ("grpo_clip", dict(advantages=adv, old_log_probs=old, clip_range=0.2)),
    ):
        where = f"policy_gradient_loss(log_probs (4, 5), kind={kind!r})"
        lp, ref = logp.clone().requires_grad_(), logp.clone().requires_grad_()
        got = call(where, fn, lp, kind=kind, **kwargs)
        wanted = policy_gradient.policy_gradient_loss(ref, kind=kind, **kwargs)
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(0.8, 1.2)
        wrong = {
            "max instead of min: the surrogate is -min(ratio A, clip(ratio) A).": -torch.maximum(
                ratio * adv, clipped * adv
            )
        }
        hint = "per token, minus the advantage (or reward) times the log-prob (or the ratio)."
        expect_close(
            got,
            wanted.detach(),
            where,
            hint,
            atol=1e-12,
            rtol=0,
            mistakes=wrong if kind == "grpo_clip" else None,
        )
        expect(
            got.requires_grad,
            where,
            "the loss has no gradient.",
            "the ratio exp(log_probs - old_log_probs) must keep log_probs' gradient.",
        )
        got.sum().backward(), wanted.sum().backward()
        expect_close(
            lp.grad,
            ref.grad,
            f"{where}, the gradient",
            "detach old_log_probs only, never log_probs.",
            atol=1e-12,
            rtol=0,
        )
    passed("policy_gradient_loss")
