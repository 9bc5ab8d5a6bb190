"""The chat format: how a prompt and its response become one token sequence a decoder trains on.

A conversation is `<|user|>{prompt}<|assistant|>{response}<|end|>`, the three markers being
special tokens of the course's `BPETokenizer` (train it with `special_tokens=CHAT_TOKENS`), so
that no text can spell them by accident. Supervised fine-tuning trains only on what the
assistant says: `tokenize_chat` returns the ids, the labels (the ids shifted left by one) and a
`response_mask` aligned with the labels that is True where the label is a response token or
the end token, as Stanford CS336's `tokenize_prompt_and_output`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from transformer_course import validate

__all__ = ["USER", "ASSISTANT", "END", "CHAT_TOKENS", "chat_prompt", "tokenize_chat"]

USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
CHAT_TOKENS = (USER, ASSISTANT, END)


def _plain(name: str, text: Any, tokenizer: Any) -> str:
    """`text` as a str holding none of the tokenizer's special tokens: user text that spelled
    `<|end|>` would otherwise end the conversation where the user chose (refused, not escaped)."""
    validate.text(name, text, utf8=True)
    for token in getattr(tokenizer, "special_tokens", {}):
        if token in text:
            raise ValueError(
                f"{name}: expected text without the special token {token!r} (the chat format "
                f"refuses it in user text), got {text!r}"
            )
    return text


def chat_prompt(prompt: str) -> str:
    """The text the model continues to answer `prompt`: `<|user|>{prompt}<|assistant|>`.

    Course: chapter 9.
    """
    return f"{USER}{validate.text('prompt', prompt)}{ASSISTANT}"


def tokenize_chat(
    prompts: Sequence[str], responses: Sequence[str], tokenizer: Any, *, n_ctx: int | None = None
) -> dict[str, Tensor]:
    """Token ids, labels and response mask of a batch of conversations.

    Row `i` is `<|user|>{prompts[i]}<|assistant|>` then `{responses[i]}<|end|>`, encoded
    separately and concatenated, then right-padded with the `<|end|>` id to the batch's longest
    row. With `full` that padded `(batch, longest)` tensor: `input_ids = full[:, :-1]`, `labels
    = full[:, 1:]`, and `response_mask` (bool, aligned with `labels`) is True exactly where the
    label is a response token or the row's own end token: False on the prompt and the padding.

    Refused, with an error naming the row: a prompt or response holding a special token's text
    (not escaped), an empty response, a conversation longer than `n_ctx` tokens.

    Course: chapter 9, exercise 9.1, checked by checks.assistant.check_tokenize_chat.
    """
    validate.sentences("prompts", prompts), validate.sentences("responses", responses)
    validate.special_tokens("tokenizer", tokenizer, CHAT_TOKENS)
    if len(prompts) != len(responses) or not len(prompts):
        raise ValueError(
            f"responses: expected one response per prompt (at least one), got {len(prompts)} "
            f"prompts and {len(responses)} responses"
        )
    rows, starts = [], []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        prompt_ids = tokenizer.encode(chat_prompt(_plain(f"prompts[{i}]", prompt, tokenizer)))
        if not _plain(f"responses[{i}]", response, tokenizer):
            raise ValueError(f"responses[{i}]: expected a non-empty response, got ''")
        response_ids = tokenizer.encode(response + END)
        row = prompt_ids + response_ids
        if n_ctx is not None and len(row) > validate.positive_int("n_ctx", n_ctx):
            raise ValueError(
                f"responses[{i}]: the conversation is {len(row)} tokens, longer than n_ctx={n_ctx}"
            )
        rows.append(row)
        starts.append(len(prompt_ids))
    longest, pad = max(map(len, rows)), tokenizer.special_tokens[END]
    full = torch.full((len(rows), longest), pad, dtype=torch.long)
    in_response = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, (row, start) in enumerate(zip(rows, starts)):
        full[i, : len(row)] = torch.tensor(row)
        in_response[i, start : len(row)] = True
    return {
        "input_ids": full[:, :-1],
        "labels": full[:, 1:],
        "response_mask": in_response[:, 1:],
    }
