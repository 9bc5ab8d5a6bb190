"""Group-normalised advantages and the policy-gradient losses (`policy_gradient`) against
formulas written here in float64 (CS336's `compute_group_normalized_rewards`; REINFORCE; GRPO's
clipped surrogate, Shao et al., 2024), values and gradients: 1e-12. The clipped surrogate's
gradient is exactly zero where the clip is active. Bad input is refused."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_course.policy_gradient import group_normalized_rewards, policy_gradient_loss

REWARDS = torch.tensor(
    [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0], dtype=torch.float64
)


@pytest.mark.parametrize("by_std", [True, False])
def test_group_normalized_rewards_match_the_formula(by_std):
    advantages, raw = group_normalized_rewards(REWARDS, 4, normalize_by_std=by_std, eps=1e-6)
    assert raw is REWARDS or torch.equal(raw, REWARDS)
    expected = []
    for g in range(3):
        group = REWARDS[4 * g : 4 * g + 4].tolist()
        mean = sum(group) / 4
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / 3)  # unbiased, as torch.std
        expected += [(r - mean) / (std + 1e-6) if by_std else r - mean for r in group]
    torch.testing.assert_close(
        advantages, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0
    )
    assert advantages[4:8].abs().max() == 0  # a group of equal rewards teaches nothing


def test_group_normalized_rewards_refuse_bad_input():
    with pytest.raises(ValueError, match="group_size: expected a positive divisor"):
        group_normalized_rewards(REWARDS, 5)
    with pytest.raises(ValueError, match="group_size: expected >= 2"):
        group_normalized_rewards(REWARDS, 1)
    with pytest.raises(ValueError, match="rewards: expected a 1-d float"):
        group_normalized_rewards(REWARDS.view(3, 4), 4)


G = torch.Generator().manual_seed(0)
LOGP = -3 * torch.rand(4, 5, generator=G, dtype=torch.float64)
OLD = LOGP + 0.4 * torch.randn(4, 5, generator=G, dtype=torch.float64)  # ratios clip at 0.2
ADV = torch.tensor([[1.5], [-0.7], [0.3], [-2.0]], dtype=torch.float64)


def test_no_baseline_and_reinforce_with_baseline():
    for kind, key in (("no_baseline", "rewards"), ("reinforce_with_baseline", "advantages")):
        lp = LOGP.clone().requires_grad_()
        loss = policy_gradient_loss(lp, kind=kind, **{key: ADV.flatten()})
        torch.testing.assert_close(loss, -ADV * LOGP, atol=1e-12, rtol=0)
        loss.sum().backward()
        torch.testing.assert_close(lp.grad, (-ADV).expand(4, 5), atol=1e-12, rtol=0)


def test_grpo_clip_matches_the_formula_and_its_gradient_vanishes_where_clipped():
    eps, lp = 0.2, LOGP.clone().requires_grad_()
    loss = policy_gradient_loss(
        lp, kind="grpo_clip", advantages=ADV, old_log_probs=OLD, clip_range=eps
    )
    expected, gradient = torch.empty(4, 5, dtype=torch.float64), torch.empty(4, 5).double()
    for b in range(4):
        for t in range(5):
            a, ratio = ADV[b, 0].item(), math.exp(LOGP[b, t].item() - OLD[b, t].item())
            unclipped, clipped = ratio * a, min(max(ratio, 1 - eps), 1 + eps) * a
            expected[b, t] = -min(unclipped, clipped)
            active = clipped < unclipped  # the min picked the clipped, constant term
            gradient[b, t] = 0.0 if active else -ratio * a
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, gradient, atol=1e-12, rtol=0)
    zero = gradient == 0
    assert zero.any() and (~zero).any()  # both cases are exercised
    assert (lp.grad[zero] == 0).all()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(kind="ppo"), "kind: expected one of"),
        (dict(kind="no_baseline"), "rewards: kind='no_baseline' needs rewards"),
        (dict(kind="no_baseline", rewards=ADV, advantages=ADV), "advantages: kind='no_baseline'"),
        (dict(kind="reinforce_with_baseline", advantages=ADV[:3]), "advantages: expected shape"),
        (dict(kind="grpo_clip", advantages=ADV, old_log_probs=OLD), "clip_range: kind="),
        (
            dict(kind="grpo_clip", advantages=ADV, old_log_probs=OLD[:, :4], clip_range=0.2),
            "old_log_probs: expected the shape",
        ),
        (dict(kind="grpo_clip", advantages=ADV, old_log_probs=OLD, clip_range=1.0), "clip_range"),
        (dict(kind="grpo_clip", advantages=ADV, old_log_probs=OLD, clip_range=0.0), "clip_range"),
    ],
)
def test_bad_input_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words):
        policy_gradient_loss(LOGP, **kwargs)
