"""GRPO's loop (`grpo`): the rollout batch lays sampled ids out as `tokenize_chat` lays out
text (exact ids and masks), rollouts are seeded and scored by the task's reward, and one update
on the clipped surrogate moves the policy towards the responses with positive advantage."""

from __future__ import annotations

import pytest
import torch

from transformer_course.assistant_task import pretraining_text, task_splits
from transformer_course.chat import END, chat_prompt, tokenize_chat
from transformer_course.fine_tuning import task_tokenizer
from transformer_course.grpo import grpo_train, grpo_update, rollout_batch, sample_rollouts
from transformer_course.llama import Llama, LlamaConfig
from transformer_course.logprobs import masked_mean, response_log_probs

SPLITS = task_splits(0)


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer(pretraining_text(SPLITS["train"] + SPLITS["harder"]), 290)


def _model(tokenizer):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        d_model=32, n_layers=1, n_heads=2, d_vocab=tokenizer.vocab_size, n_ctx=48, d_mlp=64
    )
    return Llama(cfg)


def test_rollout_batch_matches_tokenize_chat(tokenizer):
    problems = SPLITS["train"][:4]
    end = tokenizer.special_tokens[END]
    prompt_ids = [tokenizer.encode(chat_prompt(p.prompt)) for p in problems]
    response_ids = [tokenizer.encode(p.response) + [end] for p in problems]
    got = rollout_batch(prompt_ids, response_ids, end)
    want = tokenize_chat([p.prompt for p in problems], [p.response for p in problems], tokenizer)
    for key in want:
        assert torch.equal(got[key], want[key])
    with pytest.raises(ValueError, match="response_ids"):
        rollout_batch(prompt_ids, response_ids[:2], end)


def test_rollouts_are_seeded_grouped_and_scored(tokenizer):
    model, problems = _model(tokenizer), SPLITS["train"][:3]
    runs = [
        sample_rollouts(
            model,
            tokenizer,
            problems,
            4,
            max_new_tokens=5,
            generator=torch.Generator().manual_seed(2),
        )
        for _ in range(2)
    ]
    assert runs[0]["texts"] == runs[1]["texts"] and len(runs[0]["texts"]) == 12
    assert runs[0]["batch"]["input_ids"].shape[0] == 12
    assert runs[0]["rewards"].tolist() == [0.0] * 12  # an untrained model: no right answers


def test_an_update_raises_the_log_prob_of_advantaged_responses(tokenizer):
    model, problems = _model(tokenizer), SPLITS["train"][:2]
    end = tokenizer.special_tokens[END]
    prompt_ids = [tokenizer.encode(chat_prompt(p.prompt)) for p in problems for _ in range(2)]
    responses = [problems[0].response, "nope", problems[1].response, "never"]  # no shared words
    batch = rollout_batch(prompt_ids, [tokenizer.encode(r) + [end] for r in responses], end)
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = batch["response_mask"]

    def mean_log_probs():
        with torch.no_grad():
            return masked_mean(
                response_log_probs(model, batch["input_ids"], batch["labels"]), mask, dim=1
            )

    before = mean_log_probs()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    grpo_update(model, optimizer, batch, advantages, before[:, None].expand_as(mask).clone(), 0.2)
    change = mean_log_probs() - before
    assert (change[advantages > 0] > 0).all() and (change[advantages < 0] < 0).all()


def test_grpo_train_records_each_step(tokenizer):
    model = _model(tokenizer)
    history = grpo_train(
        model,
        tokenizer,
        SPLITS["harder_train"],
        steps=2,
        prompts_per_step=2,
        group_size=2,
        inner_steps=2,
        lr=1e-3,
        max_new_tokens=4,
        generator=torch.Generator().manual_seed(0),
    )
    assert len(history) == 2
    assert set(history[0]) == {
        "reward",
        "format_reward",
        "length",
        "entropy",
        "sample_seconds",
        "score_seconds",
        "update_seconds",
    }
    assert all(1 <= h["length"] <= 4 and h["entropy"] > 0 for h in history)


def test_grpo_train_evaluates_before_each_step_and_refuses_bad_settings(tokenizer):
    model, seen = _model(tokenizer), []

    def evaluate(policy):
        seen.append(policy)
        return {"accuracy": 0.25 * len(seen)}

    settings = dict(steps=2, group_size=2, inner_steps=1, lr=1e-3, max_new_tokens=3)
    history = grpo_train(
        model,
        tokenizer,
        SPLITS["harder_train"],
        prompts_per_step=1,
        generator=torch.Generator().manual_seed(0),
        evaluate=evaluate,
        **settings,
    )
    assert seen == [model, model] and [h["accuracy"] for h in history] == [0.25, 0.5]
    for bad, words in [
        (dict(prompts_per_step=0), "prompts_per_step: expected"),
        (dict(prompts_per_step=1, evaluate=3), "evaluate: expected a function"),
    ]:
        with pytest.raises(ValueError, match=words):
            grpo_train(
                model,
                tokenizer,
                SPLITS["harder_train"],
                generator=torch.Generator().manual_seed(0),
                **settings,
                **bad,
            )
