"""Direct preference optimisation (Rafailov et al., 2023): learn from pairs of responses, one
chosen over the other, without a reward model or sampling.

The policy's implicit reward of a response is `beta * (log pi(y|x) - log pi_ref(y|x))`: how
much more likely the policy makes it than the frozen reference (the SFT model) does. The loss
is the logistic loss of the chosen response's reward beating the rejected one's:
`-log sigmoid(beta * ((pc - rc) - (pr - rr)))`. A small `beta` lets the policy move far from
the reference; a large one holds it close.

The pairs come from the SFT model's own samples (`preference_pairs`): for a question it answers
sometimes right and sometimes wrong, a right answer is chosen over a wrong one. `dpo_train`
trains on them against a frozen copy of the model it starts from.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.assistant_task import Problem, reward
from transformer_course.chat import tokenize_chat
from transformer_course.fine_tuning import complete, response_text
from transformer_course.logprobs import masked_normalize, response_log_probs
from transformer_course.optim import AdamW

__all__ = [
    "dpo_loss",
    "implicit_reward",
    "PreferencePair",
    "preference_pairs",
    "sequence_log_probs",
    "dpo_train",
]

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

    Course: chapter 9, exercise 9.8, checked by checks.assistant.check_dpo_loss.
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


class PreferencePair(NamedTuple):
    """A prompt, the response chosen and the one rejected."""

    prompt: str
    chosen: str
    rejected: str


def preference_pairs(
    model: nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    samples: int,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    generator: torch.Generator | None = None,
) -> list[PreferencePair]:
    """Pairs from `model`'s own answers: `samples` responses per problem, sampled at
    `temperature`; for each problem with a right one (reward 1) and a wrong one, the first right
    one is chosen over the first wrong one. Problems it gets always right or always wrong give no
    pair (nothing to prefer), so there may be fewer pairs than problems. A sample that spells a
    chat marker (a special token sampled inside the answer) is no candidate: `tokenize_chat`
    refuses such text as a response.

    Course: chapter 9.
    """
    validate.positive_int("samples", samples)
    if not len(problems):
        raise ValueError("problems: expected at least one problem, got none")
    prompts = [p.prompt for p in problems for _ in range(samples)]
    responses = complete(
        model,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
    )
    pairs = []
    for i, problem in enumerate(problems):
        texts = [response_text(tokenizer, r) for r in responses[i * samples : (i + 1) * samples]]
        right = [t for t in texts if reward(t, problem.answer)["reward"] == 1.0]
        wrong = [
            t
            for t in texts
            if reward(t, problem.answer)["reward"] == 0.0
            and t.strip()
            and not any(marker in t for marker in tokenizer.special_tokens)
        ]
        if right and wrong:
            pairs.append(PreferencePair(problem.prompt, right[0], wrong[0]))
    return pairs


def sequence_log_probs(model: nn.Module, batch: dict[str, Tensor]) -> Float[Tensor, " batch"]:
    """Each row's response log-probability under `model`: its response tokens' log-probs
    summed (the end token's included), float32. `batch` is `tokenize_chat`'s.

    Course: chapter 9.
    """
    log_probs = response_log_probs(model, batch["input_ids"], batch["labels"])
    return masked_normalize(log_probs, batch["response_mask"], dim=1)


def dpo_train(
    policy: nn.Module,
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    *,
    steps: int,
    batch_size: int,
    beta: float,
    lr: float,
    generator: torch.Generator,
    reference: nn.Module | None = None,
) -> list[dict[str, float]]:
    """DPO from `policy` on random batches of `pairs`, against `reference` (default: a frozen
    copy of `policy` as it starts, the SFT model). Returns, per step, the loss, the mean
    implicit rewards of the chosen and rejected responses and their margin, the share of pairs
    whose margin is positive, and the policy's mean chosen and rejected sequence log-probs.

    Course: chapter 9.
    """
    validate.positive_int("steps", steps)
    validate.positive_int("batch_size", batch_size)
    validate.number("beta", beta, low=0, low_open=True)
    if not len(pairs):
        raise ValueError("pairs: expected at least one preference pair, got none")
    reference = copy.deepcopy(policy) if reference is None else reference
    reference.eval().requires_grad_(False)
    optimizer = AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    history = []
    policy.train()
    for _ in range(steps):
        pick = torch.randint(len(pairs), (batch_size,), generator=generator).tolist()
        prompts = [pairs[i].prompt for i in pick]
        chosen = tokenize_chat(prompts, [pairs[i].chosen for i in pick], tokenizer)
        rejected = tokenize_chat(prompts, [pairs[i].rejected for i in pick], tokenizer)
        with torch.no_grad():
            ref_chosen = sequence_log_probs(reference, chosen)
            ref_rejected = sequence_log_probs(reference, rejected)
        policy_chosen = sequence_log_probs(policy, chosen)
        policy_rejected = sequence_log_probs(policy, rejected)
        loss = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        reward_chosen = implicit_reward(policy_chosen, ref_chosen, beta)
        reward_rejected = implicit_reward(policy_rejected, ref_rejected, beta)
        margin = reward_chosen - reward_rejected
        history.append(
            {
                "loss": loss.item(),
                "chosen_reward": reward_chosen.mean().item(),
                "rejected_reward": reward_rejected.mean().item(),
                "margin": margin.mean().item(),
                "reward_accuracy": (margin > 0).float().mean().item(),
                "chosen_log_prob": policy_chosen.detach().mean().item(),
                "rejected_log_prob": policy_rejected.detach().mean().item(),
            }
        )
    policy.eval()
    return history
