"""GRPO (Shao et al., 2024) on the task's verifiable reward: sample a group of responses per
prompt with the KV cache, score each with the reward function, and take several clipped
policy-gradient steps on that batch of rollouts.

A step's time goes to three places, which `grpo_train` records apart: sampling (token by token,
the KV cache keeping each token's cost constant), scoring (decoding and parsing, cheap) and the
update (a forward and backward per inner step over the whole rollout batch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.assistant_task import Problem, reward
from transformer_course.chat import END, chat_prompt
from transformer_course.fine_tuning import complete, response_text
from transformer_course.logprobs import masked_mean, response_log_probs, token_entropy
from transformer_course.optim import AdamW
from transformer_course.policy_gradient import group_normalized_rewards, policy_gradient_loss
from transformer_course.runtime import evaluating

__all__ = ["rollout_batch", "sample_rollouts", "grpo_update", "grpo_train"]


def rollout_batch(
    prompt_ids: Sequence[list[int]], response_ids: Sequence[list[int]], pad_id: int
) -> dict[str, Tensor]:
    """Prompts and sampled responses (ids, as sampled: no re-encoding) as `tokenize_chat`
    lays them out: `input_ids`, `labels` (shifted left by one) and `response_mask` on the
    labels that are response tokens, right padding with `pad_id`.

    Course: chapter 9.
    """
    if len(prompt_ids) != len(response_ids) or not len(prompt_ids):
        raise ValueError(
            f"response_ids: expected one response per prompt (at least one), got "
            f"{len(prompt_ids)} prompts and {len(response_ids)} responses"
        )
    rows = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
    full = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    in_response = torch.zeros(full.shape, dtype=torch.bool)
    for i, (row, prompt) in enumerate(zip(rows, prompt_ids)):
        full[i, : len(row)] = torch.tensor(row)
        in_response[i, len(prompt) : len(row)] = True
    return {"input_ids": full[:, :-1], "labels": full[:, 1:], "response_mask": in_response[:, 1:]}


def sample_rollouts(
    policy: nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    group_size: int,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """`group_size` sampled responses per problem (consecutive rows), their rewards and the
    rollout batch, with the seconds spent sampling and scoring.

    Course: chapter 9.
    """
    validate.positive_int("group_size", group_size)
    prompts = [p.prompt for p in problems for _ in range(group_size)]
    answers = [p.answer for p in problems for _ in range(group_size)]
    start = time.perf_counter()
    responses = complete(
        policy,
        tokenizer,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        generator=generator,
    )
    sampled = time.perf_counter()
    texts = [response_text(tokenizer, r) for r in responses]
    scores = [reward(t, a) for t, a in zip(texts, answers)]
    rewards = torch.tensor([s["reward"] for s in scores])
    scored = time.perf_counter()
    prompt_ids = [tokenizer.encode(chat_prompt(p)) for p in prompts]
    batch = rollout_batch(prompt_ids, responses, tokenizer.special_tokens[END])
    return {
        "texts": texts,
        "rewards": rewards,
        "format_rewards": torch.tensor([s["format_reward"] for s in scores]),
        "batch": batch,
        "sample_seconds": sampled - start,
        "score_seconds": scored - sampled,
    }


def grpo_update(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    advantages: Tensor,
    old_log_probs: Tensor,
    clip_range: float,
) -> float:
    """One step on GRPO's clipped surrogate: the per-token loss averaged over each response's
    tokens, then over the responses (GRPO's sequence-level mean). Returns the loss.

    Course: chapter 9.
    """
    log_probs = response_log_probs(policy, batch["input_ids"], batch["labels"])
    per_token = policy_gradient_loss(
        log_probs,
        kind="grpo_clip",
        advantages=advantages,
        old_log_probs=old_log_probs,
        clip_range=clip_range,
    )
    loss = masked_mean(per_token, batch["response_mask"], dim=1).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def grpo_train(
    policy: nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    steps: int,
    prompts_per_step: int,
    group_size: int,
    inner_steps: int,
    lr: float,
    clip_range: float = 0.2,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    generator: torch.Generator,
    evaluate: Callable[[nn.Module], dict[str, float]] | None = None,
) -> list[dict[str, float]]:
    """GRPO from `policy` on random prompts of `problems`: per step, rollouts, group-normalized
    advantages, `inner_steps` clipped updates against the sampling policy's log-probs. Returns,
    per step, the mean reward, format reward, response length and response-token entropy of the
    rollouts, and the seconds spent sampling, scoring and updating; with `evaluate` (the policy
    -> named numbers, held-out accuracy say), also what it returns before the step's rollouts.

    Course: chapter 9.
    """
    validate.positive_int("inner_steps", inner_steps)
    validate.positive_int("prompts_per_step", prompts_per_step)
    if evaluate is not None and not callable(evaluate):
        raise ValueError(f"evaluate: expected a function of the policy, got {evaluate!r}")
    optimizer = AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    history = []
    for _ in range(validate.positive_int("steps", steps)):
        measured = {} if evaluate is None else dict(evaluate(policy))
        pick = torch.randint(len(problems), (prompts_per_step,), generator=generator).tolist()
        rollouts = sample_rollouts(
            policy,
            tokenizer,
            [problems[i] for i in pick],
            group_size,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            generator=generator,
        )
        batch, mask = rollouts["batch"], rollouts["batch"]["response_mask"]
        advantages, raw = group_normalized_rewards(rollouts["rewards"], group_size)
        start = time.perf_counter()
        with evaluating(policy):
            old_log_probs = response_log_probs(policy, batch["input_ids"], batch["labels"])
            entropy = masked_mean(token_entropy(policy(batch["input_ids"])), mask)
        policy.train()
        for _ in range(inner_steps):
            grpo_update(policy, optimizer, batch, advantages, old_log_probs, clip_range)
        history.append(
            {
                "reward": raw.mean().item(),
                "format_reward": rollouts["format_rewards"].mean().item(),
                "length": mask.sum(dim=1).float().mean().item(),
                "entropy": entropy.item(),
                "sample_seconds": rollouts["sample_seconds"],
                "score_seconds": rollouts["score_seconds"],
                "update_seconds": time.perf_counter() - start,
                **measured,
            }
        )
    policy.eval()
    return history
