"""The DPO loss (`dpo.dpo_loss`) against the paper's formula (Rafailov et al., 2023, eq. 7)
written here in float64, value and gradients: 1e-12. Bad input is refused."""

from __future__ import annotations

import math

import pytest
import torch

from transformer_course.dpo import dpo_loss, implicit_reward


def paper(pc, pr, rc, rr, beta):
    """-log sigmoid(beta ((pc - rc) - (pr - rr))), averaged, one pair at a time in floats."""
    losses = []
    for a, b, c, d in zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist()):
        z = beta * ((a - c) - (b - d))
        losses.append(math.log1p(math.exp(-z)) if z > -30 else -z)
    return sum(losses) / len(losses)


@pytest.mark.parametrize("beta", [0.1, 1.0, 5.0])
def test_dpo_loss_matches_the_paper(beta):
    g = torch.Generator().manual_seed(0)
    logps = [(-20 * torch.rand(6, generator=g, dtype=torch.float64)) for _ in range(4)]
    policy = [t.clone().requires_grad_() for t in logps[:2]]
    loss = dpo_loss(*policy, *logps[2:], beta)
    assert loss.shape == () and abs(loss.item() - paper(*logps, beta)) < 1e-12
    loss.backward()
    z = beta * ((logps[0] - logps[2]) - (logps[1] - logps[3]))
    d = -beta * torch.sigmoid(-z) / len(z)  # d loss / d policy_chosen; the rejected: minus it
    torch.testing.assert_close(policy[0].grad, d, atol=1e-12, rtol=0)
    torch.testing.assert_close(policy[1].grad, -d, atol=1e-12, rtol=0)
    rewards = implicit_reward(logps[0], logps[2], beta)
    torch.testing.assert_close(rewards, beta * (logps[0] - logps[2]), atol=1e-12, rtol=0)


def test_equal_policy_and_reference_give_log_2():
    logps = torch.tensor([-3.0, -7.0], dtype=torch.float64)
    loss = dpo_loss(logps, logps - 1, logps, logps - 1, 0.5)
    assert abs(loss.item() - math.log(2)) < 1e-12


@pytest.mark.parametrize(
    "args, words",
    [
        ((torch.zeros(3),) * 4 + (0.0,), "beta: expected"),
        ((torch.zeros(3),) * 4 + (-1.0,), "beta: expected"),
        ((torch.zeros(3),) * 3 + (torch.zeros(4), 0.1), "ref_rejected_logps: expected the shape"),
        ((torch.zeros(3, 1),) * 4 + (0.1,), "policy_chosen_logps: expected a float tensor"),
    ],
)
def test_bad_input_is_refused(args, words):
    with pytest.raises(ValueError, match=words):
        dpo_loss(*args)
