"""The chapter 9 checkers (`checks.assistant`): the reference passes, valid alternatives pass,
and each catalogue mistake is named (each written out here as a learner would write it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checking import fails

from transformer_course import dpo, logprobs, policy_gradient
from transformer_course.checks.assistant import (
    check_dpo_loss,
    check_group_normalized_rewards,
    check_masked_mean,
    check_policy_gradient_loss,
)

CHECKS = {
    check_masked_mean: (logprobs.masked_mean, "masked_mean"),
    check_dpo_loss: (dpo.dpo_loss, "dpo_loss"),
    check_group_normalized_rewards: (
        policy_gradient.group_normalized_rewards,
        "group_normalized_rewards",
    ),
    check_policy_gradient_loss: (policy_gradient.policy_gradient_loss, "policy_gradient_loss"),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_reference_passes(check, capsys):
    reference, name = CHECKS[check]
    check(reference)
    assert f"✓ {name} passes every check" in capsys.readouterr().out


def test_blank_fails():
    def blank(*args, **kwargs):
        raise NotImplementedError("Exercise 9.x")

    fails(check_dpo_loss, blank, "not implemented")


def test_masked_mean_alternative_passes_and_nan_fails(capsys):
    def alternative(x, mask, dim=None):
        mask = mask.to(x.dtype)
        return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)

    check_masked_mean(alternative)
    fails(check_masked_mean, lambda x, m, dim=None: (x * m).sum(dim) / m.sum(dim), "NaN", "0 / 0")


def test_dpo_mistakes_are_named():
    no_ref = lambda pc, pr, rc, rr, beta: -F.logsigmoid(beta * (pc - pr)).mean()
    fails(check_dpo_loss, no_ref, "reference model's log-probs are missing")
    outside = lambda pc, pr, rc, rr, beta: -beta * F.logsigmoid((pc - rc) - (pr - rr)).mean()
    fails(check_dpo_loss, outside, "beta on the wrong side")
    alternative = lambda pc, pr, rc, rr, beta: F.softplus(-beta * ((pc - pr) - (rc - rr))).mean()
    check_dpo_loss(alternative)


def test_advantages_over_the_whole_batch_are_named():
    def whole_batch(rewards, group_size, *, eps=1e-6, normalize_by_std=True):
        advantages = rewards - rewards.mean()
        if normalize_by_std:
            advantages = advantages / (rewards.std() + eps)
        return advantages, rewards

    fails(check_group_normalized_rewards, whole_batch, "whole batch")


def test_policy_gradient_mistakes_are_named():
    reference = policy_gradient.policy_gradient_loss

    def with_max(log_probs, *, kind, old_log_probs=None, clip_range=None, **kw):
        if kind != "grpo_clip":
            return reference(log_probs, kind=kind, **kw)
        a, ratio = kw["advantages"], torch.exp(log_probs - old_log_probs)
        eps = clip_range
        return -torch.maximum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)

    fails(check_policy_gradient_loss, with_max, "max instead of min")

    def detached(log_probs, *, kind, **kw):
        return reference(log_probs.detach(), kind=kind, **kw)

    fails(check_policy_gradient_loss, detached, "no gradient")
