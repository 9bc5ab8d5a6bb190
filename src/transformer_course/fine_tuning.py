"""From a pre-trained decoder to one that answers: pre-training on the task's text, supervised
fine-tuning (SFT) on the chat format, and what the model replies, sampled with the KV cache.

SFT's loss is the cross-entropy of the response tokens only (the prompt is given, not learned),
summed and divided by the number of response tokens in the whole batch. Dividing each micro
batch's sum by that same total makes gradient accumulation exactly the gradient of one large
batch, however the response tokens fall between micro batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.assistant_task import Problem, reward
from transformer_course.chat import CHAT_TOKENS, END, chat_prompt, tokenize_chat
from transformer_course.llama import llama_forward_with_cache
from transformer_course.logprobs import masked_normalize, response_log_probs
from transformer_course.optim import AdamW
from transformer_course.runtime import evaluating
from transformer_course.tokenization import BPETokenizer
from transformer_course.training import lm_loss, sample_batch

__all__ = [
    "DIGITS_APART",
    "DIGITS_AND_LINES_APART",
    "task_tokenizer",
    "pretrain",
    "sft_loss",
    "sft_step",
    "complete",
    "accuracy",
    "fine_tune",
]


# Every digit its own chunk, so no merge spans two digits: numbers are spelled digit by digit,
# the same digits in every number, which a small model can add (merged "81" would be a word).
DIGITS_APART = r"[0-9]|[^0-9]+"
# The same, with each newline a chunk of its own too: a line's first words are then the same
# tokens after a newline as after a chat marker, so text and chat share their tokens.
DIGITS_AND_LINES_APART = r"[0-9]|\n|[^0-9\n]+"


def task_tokenizer(text: str, vocab_size: int = 300) -> BPETokenizer:
    """The course's BPE tokenizer trained on the task's text, with the chat tokens special and
    each digit and each newline a token of its own (`DIGITS_AND_LINES_APART`): merges make
    words such as `"the answer is "` one token, never a number, and never join a line's words
    to the newline before them (so they are the same tokens as after a chat marker).

    Course: chapter 9.
    """
    return BPETokenizer.train(
        text, vocab_size, pattern=DIGITS_AND_LINES_APART, special_tokens=CHAT_TOKENS
    )


def pretrain(
    model: nn.Module,
    ids: Tensor,
    *,
    steps: int,
    batch_size: int,
    n_ctx: int,
    lr: float,
    generator: torch.Generator,
) -> list[float]:
    """Next-token training on the token stream `ids` with the course's AdamW; the losses.

    Course: chapter 9.
    """
    optimizer = AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(validate.positive_int("steps", steps)):
        x, y = sample_batch(ids, batch_size, n_ctx, generator=generator)
        loss = lm_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def sft_loss(model: nn.Module, batch: dict[str, Tensor], n_response_tokens: int) -> Tensor:
    """The negative log-likelihood of `batch`'s response tokens, summed, divided by
    `n_response_tokens` (those of the whole batch the step sees, not only this part).

    Course: chapter 9, exercise 9.6, checked by checks.assistant.check_sft_loss.
    """
    log_probs = response_log_probs(model, batch["input_ids"], batch["labels"])
    return masked_normalize(-log_probs, batch["response_mask"], None, n_response_tokens)


def sft_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: dict[str, Tensor],
    *,
    micro_batch_size: int | None = None,
) -> float:
    """One optimizer step on `batch` (from `tokenize_chat`), its gradient accumulated over
    micro batches of `micro_batch_size` rows: the same update as the whole batch at once.
    Returns the loss (mean over response tokens).

    Course: chapter 9.
    """
    rows = batch["input_ids"].shape[0]
    size = (
        rows
        if micro_batch_size is None
        else validate.positive_int("micro_batch_size", micro_batch_size)
    )
    n_tokens = int(batch["response_mask"].sum())
    if n_tokens == 0:
        raise ValueError("batch: expected at least one response token, got none")
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for start in range(0, rows, size):
        part = {k: v[start : start + size] for k, v in batch.items()}
        loss = sft_loss(model, part, n_tokens)
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total


def _prompt_groups(ids: list[list[int]]) -> dict[int, list[int]]:
    """Row indices by prompt length: rows of one length are generated as one batch (no
    padding, which RoPE without an attention mask could not ignore)."""
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(ids):
        groups.setdefault(len(row), []).append(i)
    return groups


def complete(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The response ids (up to and with `<|end|>`, at most `max_new_tokens`) the model gives
    each prompt in the chat format, sampled at `temperature` (0: greedy) with chapter 7's KV
    cache: each step runs only the new token through the model.

    Course: chapter 9.
    """
    validate.sentences("prompts", prompts)
    validate.positive_int("max_new_tokens", max_new_tokens)
    validate.number("temperature", temperature, low=0)
    end = tokenizer.special_tokens[END]
    ids = [tokenizer.encode(chat_prompt(p)) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    with evaluating(model):
        for rows in _prompt_groups(ids).values():
            tokens = torch.tensor([ids[i] for i in rows])
            logits, cache = llama_forward_with_cache(model, tokens)
            done = torch.zeros(len(rows), dtype=torch.bool)
            new = []
            for _ in range(max_new_tokens):
                last = logits[:, -1].float()
                if temperature == 0:
                    token = last.argmax(dim=-1)
                else:
                    probs = (last / temperature).softmax(dim=-1)
                    token = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
                token = torch.where(done, end, token)
                new.append(token)
                done |= token == end
                if bool(done.all()) or len(new) == max_new_tokens:
                    break
                logits, cache = llama_forward_with_cache(model, token[:, None], cache)
            for row, seq in zip(rows, torch.stack(new, dim=1).tolist()):
                out[row] = seq[: seq.index(end) + 1] if end in seq else seq
    return out


def response_text(tokenizer: Any, response_ids: list[int]) -> str:
    """The text of a response, without its `<|end|>`."""
    end = tokenizer.special_tokens[END]
    return tokenizer.decode([i for i in response_ids if i != end])


def accuracy(
    model: nn.Module, tokenizer: Any, problems: Sequence[Problem], *, max_new_tokens: int = 8
) -> float:
    """The share of `problems` the model answers right, greedy decoding.

    Course: chapter 9.
    """
    responses = complete(
        model, tokenizer, [p.prompt for p in problems], max_new_tokens=max_new_tokens
    )
    scores = [
        reward(response_text(tokenizer, r), p.answer)["reward"] for r, p in zip(responses, problems)
    ]
    return sum(scores) / len(scores)


def fine_tune(
    model: nn.Module,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
) -> list[float]:
    """SFT on random batches of `problems` answered in the answer format; the losses. Only the
    parameters that require a gradient train (a LoRA model's updates, say).

    Course: chapter 9.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(validate.positive_int("steps", steps)):
        pick = torch.randint(len(problems), (batch_size,), generator=generator).tolist()
        batch = tokenize_chat(
            [problems[i].prompt for i in pick], [problems[i].response for i in pick], tokenizer
        )
        losses.append(sft_step(model, optimizer, batch))
    return losses
