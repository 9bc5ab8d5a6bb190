"""The task chapter 9's assistant learns: addition questions whose answers a program checks.

A problem is `"What is 23 + 58?"` and its answer `81`; the assistant must reply in the fixed
format `"the answer is 81"`. Problems are generated, seeded: every pair of operands below
`max_operand` is shuffled once with the seed and cut into a train and a held-out split (no
question is in both), and a harder held-out split asks about operands from `max_operand` up to
`harder_max_operand` (larger numbers than fine-tuning saw), or about the same operands with
sums of at least `harder_sum` (larger answers), itself cut into a split to practise on
(`harder_train`, for reinforcement learning) and one held out (`harder`).

Before any chat, a base model can be pre-trained on `pretraining_text`: every problem as a
line of plain text (the answer on its own line, laid out as the chat format lays it out), so
the model knows the sums, and what fine-tuning and reinforcement
learning add is how to answer in the chat format with what it knows.

`reward(response, answer)` is the verifiable reward of GRPO: a format reward (the response is
exactly the answer format) and an answer reward (and its number is right). It never raises: any
string, or anything that is not one, gets a score.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from transformer_course import validate

__all__ = [
    "Problem",
    "ANSWER_FORMAT",
    "task_splits",
    "format_answer",
    "pretraining_text",
    "reward",
]

ANSWER_FORMAT = "the answer is {}"
_ANSWER = re.compile(r"the answer is (-?[0-9]{1,9})")


@dataclass(frozen=True)
class Problem:
    """One question and the number that answers it."""

    prompt: str
    answer: int

    @property
    def response(self) -> str:
        """The correct response, in the answer format."""
        return format_answer(self.answer)


def format_answer(answer: int) -> str:
    """`answer` in the format the reward checks: `"the answer is 81"`."""
    return ANSWER_FORMAT.format(validate.integer("answer", answer))


def _problem(a: int, b: int) -> Problem:
    return Problem(f"What is {a} + {b}?", a + b)


def task_splits(
    seed: int = 0,
    *,
    max_operand: int = 20,
    harder_max_operand: int = 30,
    held_out: float = 0.2,
    harder_sum: int | None = None,
) -> dict[str, list[Problem]]:
    """`{"train", "held_out", "harder_train", "harder"}`: the problems `a + b` with `a, b <
    max_operand`, shuffled with `seed` and split (a share `held_out` of them held out), and the
    harder problems with `max(a, b)` in `[max_operand, harder_max_operand)`, shuffled with
    `seed` and split the same way.

    With `harder_sum`, the harder problems are instead those with `a, b < max_operand` whose
    sum is at least `harder_sum` (the same digits as training, larger answers), the easy ones
    the rest, and `harder_max_operand` is not used.

    Course: chapter 9.
    """
    validate.integer("seed", seed)
    validate.integer("max_operand", max_operand, low=2)
    validate.number("held_out", held_out, low=0, high=1, low_open=True)
    rng = random.Random(seed)
    if harder_sum is None:
        validate.integer("harder_max_operand", harder_max_operand, low=max_operand + 1)
        easy = [_problem(a, b) for a in range(max_operand) for b in range(max_operand)]
        harder = [
            _problem(a, b)
            for a in range(harder_max_operand)
            for b in range(harder_max_operand)
            if max(a, b) >= max_operand
        ]
    else:
        validate.integer("harder_sum", harder_sum, low=1, high=2 * max_operand - 2)
        pairs = [_problem(a, b) for a in range(max_operand) for b in range(max_operand)]
        easy = [p for p in pairs if p.answer < harder_sum]
        harder = [p for p in pairs if p.answer >= harder_sum]
    rng.shuffle(easy), rng.shuffle(harder)
    n_easy, n_harder = (max(1, round(held_out * len(split))) for split in (easy, harder))
    return {
        "train": easy[n_easy:],
        "held_out": easy[:n_easy],
        "harder_train": harder[n_harder:],
        "harder": harder[:n_harder],
    }


def pretraining_text(problems: list[Problem], separator: str = " ") -> str:
    """The problems as plain text, one `question{separator}answer` line each: what the base
    model is pre-trained on before it ever sees the chat format.

    With `separator="\\n"` and a tokenizer that keeps newlines apart (`task_tokenizer`), the
    answer's digits follow the same tokens, at the same distances from the question, as in
    the chat format (where `<|assistant|>` stands in the newline's place): what pre-training
    stored is then what the chat answer reads.

    Course: chapter 9.
    """
    validate.text("separator", separator)
    return "".join(f"{p.prompt}{separator}{p.response}\n" for p in problems)


def reward(response: Any, answer: Any) -> dict[str, float]:
    """`{"reward", "format_reward", "answer_reward"}`, each 0.0 or 1.0, of `response` to a
    problem whose answer is `answer`.

    The format reward is 1 when the response, stripped of surrounding whitespace, is exactly
    `"the answer is <integer>"`; the answer reward is 1 when it also names `answer`. The reward
    is the answer reward: a right number in the wrong format earns nothing. Never raises: a
    response that is not a str, or an answer that is not an int, scores 0.

    Course: chapter 9.
    """
    zero = {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    if not isinstance(response, str) or not validate.is_int(answer):
        return zero
    match = _ANSWER.fullmatch(response.strip())
    if match is None:
        return zero
    right = float(int(match.group(1)) == answer)
    return {"reward": right, "format_reward": 1.0, "answer_reward": right}
