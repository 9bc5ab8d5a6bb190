"""The DPO loss (`dpo.dpo_loss`) against the paper's formula (Rafailov et al., 2023, eq. 7)
written here in float64, value and gradients: 1e-12. Its loop: sequence log-probs equal to the
response tokens' cross-entropy summed (written with `F.cross_entropy`), a first step at log 2
(the policy is its own reference), margins that grow, and pairs built from a model's samples
that pick a right answer over a wrong one. Bad input is refused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transformer_course import dpo
from transformer_course.assistant_task import Problem, pretraining_text, task_splits
from transformer_course.chat import ASSISTANT, END, tokenize_chat
from transformer_course.dpo import (
    PreferencePair,
    dpo_loss,
    dpo_train,
    implicit_reward,
    preference_pairs,
    sequence_log_probs,
)
from transformer_course.fine_tuning import task_tokenizer
from transformer_course.llama import Llama, LlamaConfig

SPLITS = task_splits(0)


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer(pretraining_text(SPLITS["train"] + SPLITS["harder"]), 290)


def _model(tokenizer, dtype=torch.float32):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        d_model=32, n_layers=1, n_heads=2, d_vocab=tokenizer.vocab_size, n_ctx=48, d_mlp=64
    )
    return Llama(cfg).to(dtype)


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


def test_sequence_log_probs_sum_the_response_tokens(tokenizer):
    model = _model(tokenizer, torch.float64)
    problems = SPLITS["train"][:3]
    batch = tokenize_chat([p.prompt for p in problems], ["the answer is 5", "x", "y z"], tokenizer)
    logits = model(batch["input_ids"])
    nll = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    expected = -(nll * batch["response_mask"]).sum(dim=1)
    torch.testing.assert_close(sequence_log_probs(model, batch), expected.float())


def test_dpo_train_starts_at_log_2_and_widens_the_margin(tokenizer):
    model = _model(tokenizer)
    pairs = [
        PreferencePair(p.prompt, p.response, f"the answer is {p.answer + 1}")
        for p in SPLITS["train"][:4]
    ]
    history = dpo_train(
        model,
        tokenizer,
        pairs,
        steps=8,
        batch_size=4,
        beta=0.5,
        lr=3e-3,
        generator=torch.Generator().manual_seed(0),
    )
    assert abs(history[0]["loss"] - math.log(2)) < 1e-6  # the policy is its own reference
    assert history[0]["margin"] == 0.0
    assert history[-1]["margin"] > 0.1 and history[-1]["loss"] < history[0]["loss"]
    last = history[-1]
    assert abs(last["margin"] - (last["chosen_reward"] - last["rejected_reward"])) < 1e-5


def test_preference_pairs_choose_a_right_answer_over_a_wrong_one(tokenizer, monkeypatch):
    problems = [Problem("What is 1 + 2?", 3), Problem("What is 2 + 2?", 4)]
    texts = ["the answer is 5", "the answer is 3", "the answer is 4", "the answer is 4"]
    end = tokenizer.special_tokens[END]

    def sampled(model, tok, prompts, **settings):
        assert prompts == [problems[0].prompt] * 2 + [problems[1].prompt] * 2
        return [tok.encode(t) + [end] for t in texts]

    monkeypatch.setattr(dpo, "complete", sampled)
    pairs = preference_pairs(None, tokenizer, problems, samples=2)
    assert pairs == [PreferencePair("What is 1 + 2?", "the answer is 3", "the answer is 5")]


def test_preference_pairs_skip_a_sample_that_spells_a_chat_marker(tokenizer, monkeypatch):
    # A sampled <|assistant|> mid-answer decodes to its text, which tokenize_chat refuses as a
    # response: such a sample is never the rejected answer.
    problem = Problem("What is 1 + 2?", 3)
    assistant, end = (tokenizer.special_tokens[t] for t in (ASSISTANT, END))
    spelled = tokenizer.encode("the answer is 7") + [assistant] + tokenizer.encode("the answer")
    sampled = [spelled + [end]] + [tokenizer.encode(t) + [end] for t in ("the answer is 3", "4")]
    monkeypatch.setattr(dpo, "complete", lambda *args, **settings: sampled)
    pairs = preference_pairs(None, tokenizer, [problem], samples=3)
    assert pairs == [PreferencePair("What is 1 + 2?", "the answer is 3", "4")]
    tokenize_chat([pairs[0].prompt], [pairs[0].rejected], tokenizer)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(steps=0), "steps: expected"),
        (dict(beta=0.0), "beta: expected"),
        (dict(pairs=[]), "pairs: expected at least one"),
    ],
)
def test_dpo_train_refuses_bad_settings(tokenizer, settings, words):
    pair = PreferencePair("What is 1 + 2?", "the answer is 3", "the answer is 4")
    args = dict(pairs=[pair], steps=1, batch_size=1, beta=0.1, lr=1e-3)
    args.update(settings)
    with pytest.raises(ValueError, match=words):
        dpo_train(_model(tokenizer), tokenizer, generator=torch.Generator(), **args)
    with pytest.raises(ValueError, match="samples: expected"):
        preference_pairs(_model(tokenizer), tokenizer, SPLITS["train"][:1], samples=0)
