"""The task of chapter 9 (`assistant_task`): seeded splits that never share a question, answers
that are the sums, and a reward that scores any input, adversarial strings included, without
raising. Exact comparisons only."""

from __future__ import annotations

import pytest

from transformer_course.assistant_task import (
    Problem,
    format_answer,
    pretraining_text,
    reward,
    task_splits,
)


def test_splits_are_seeded_disjoint_and_correct():
    splits = task_splits(3)
    assert splits == task_splits(3) and splits != task_splits(4)
    prompts = {name: {p.prompt for p in split} for name, split in splits.items()}
    assert not prompts["train"] & prompts["held_out"]
    assert not prompts["harder_train"] & prompts["harder"]
    easy = prompts["train"] | prompts["held_out"]
    assert not (prompts["harder"] | prompts["harder_train"]) & easy
    assert len(easy) == 20 * 20 and len(prompts["held_out"]) == 80
    assert len(prompts["harder"]) + len(prompts["harder_train"]) == 30 * 30 - 20 * 20
    for split in splits.values():
        for p in split:
            a, b = (int(n) for n in p.prompt.removeprefix("What is ").rstrip("?").split(" + "))
            assert p.answer == a + b
    assert all(
        max(map(int, p.prompt[8:-1].split(" + "))) >= 20
        for p in splits["harder"] + splits["harder_train"]
    )


def test_pretraining_text_and_response_format():
    problem = Problem("What is 23 + 58?", 81)
    assert problem.response == format_answer(81) == "the answer is 81"
    assert pretraining_text([problem]) == "What is 23 + 58? the answer is 81\n"
    assert pretraining_text([problem], "\n") == "What is 23 + 58?\nthe answer is 81\n"
    with pytest.raises(TypeError, match="separator: expected a str"):
        pretraining_text([problem], None)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("the answer is 81", (1.0, 1.0)),
        ("  the answer is 81\n", (1.0, 1.0)),
        ("the answer is 80", (0.0, 1.0)),
        ("the answer is -81", (0.0, 1.0)),
        ("the answer is 81!", (0.0, 0.0)),
        ("The answer is 81", (0.0, 0.0)),
        ("81", (0.0, 0.0)),
        ("the answer is 81 the answer is 81", (0.0, 0.0)),
        ("the answer is 8 1", (0.0, 0.0)),
        ("the answer is ", (0.0, 0.0)),
        ("the answer is 99999999999999999999999", (0.0, 0.0)),
        ("the answer is ٨١", (0.0, 0.0)),  # Arabic-Indic digits are not the format's digits
        ("", (0.0, 0.0)),
        ("\x00\ud800<|end|>", (0.0, 0.0)),
        (None, (0.0, 0.0)),
        (81, (0.0, 0.0)),
        (b"the answer is 81", (0.0, 0.0)),
    ],
)
def test_reward_never_raises(response, expected):
    scores = reward(response, 81)
    assert set(scores) == {"reward", "format_reward", "answer_reward"}
    assert (scores["answer_reward"], scores["format_reward"]) == expected
    assert scores["reward"] == scores["answer_reward"]


@pytest.mark.parametrize("answer", [None, "81", 81.0, True])
def test_reward_with_a_bad_answer_scores_zero(answer):
    assert reward("the answer is 81", answer)["reward"] == 0.0


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="harder_max_operand"):
        task_splits(0, max_operand=20, harder_max_operand=20)
    with pytest.raises(ValueError, match="held_out"):
        task_splits(0, held_out=0.0)


def test_harder_by_sum_keeps_the_digits_and_raises_the_answers():
    splits = task_splits(1, max_operand=10, harder_sum=10, held_out=0.4)
    easy = splits["train"] + splits["held_out"]
    harder = splits["harder_train"] + splits["harder"]
    assert len(easy) == 55 and len(harder) == 45 and len(splits["harder"]) == 18
    assert all(p.answer < 10 for p in easy) and all(p.answer >= 10 for p in harder)
    assert len({p.prompt for p in easy + harder}) == 100
    assert splits == task_splits(1, max_operand=10, harder_sum=10, held_out=0.4)
    with pytest.raises(ValueError, match="harder_sum"):
        task_splits(0, max_operand=10, harder_sum=19)
