"""The chat format (`chat.tokenize_chat`) against what it must mean, read back by decoding: the
labels are the inputs one position on, the masked labels decode to exactly the response and its
end token, the unmasked ones to the prompt's chat markup and the padding; bad input is refused.
Exact comparisons only (ids, masks, strings)."""

from __future__ import annotations

import pytest
import torch

from transformer_course.chat import ASSISTANT, CHAT_TOKENS, END, USER, chat_prompt, tokenize_chat
from transformer_course.tokenization import BPETokenizer

TEXT = "".join(
    f"{USER}what is {i} plus {i + 3}?{ASSISTANT}the answer is {2 * i + 3}{END}" for i in range(40)
)
PROMPTS = ["what is 2 plus 5?", "what is 12 plus 30?", "hi"]
RESPONSES = ["the answer is 7", "the answer is 42", "the answer is 1234567"]


@pytest.fixture(scope="module")
def tokenizer():
    return BPETokenizer.train(TEXT, 300, special_tokens=CHAT_TOKENS)


def test_labels_are_inputs_shifted_and_mask_covers_the_response(tokenizer):
    batch = tokenize_chat(PROMPTS, RESPONSES, tokenizer)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["response_mask"]
    assert ids.shape == labels.shape == mask.shape and mask.dtype == torch.bool
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    end = tokenizer.special_tokens[END]
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES)):
        row = [ids[i, 0].item(), *labels[i].tolist()]
        assert tokenizer.decode(labels[i][mask[i]].tolist()) == response + END
        length = len(tokenizer.encode(chat_prompt(prompt) + response + END))
        assert tokenizer.decode(row[:length]) == chat_prompt(prompt) + response + END
        assert all(t == end for t in row[length:])  # padded with the end id
        assert not mask[i, length - 1 :].any()  # ... which the mask leaves out
        first = int(mask[i].nonzero()[0])  # the first masked label is the response's first
        assert tokenizer.decode(row[: first + 1]) == chat_prompt(prompt)
    assert (
        labels.shape[1]
        == max(len(tokenizer.encode(chat_prompt(p) + r + END)) for p, r in zip(PROMPTS, RESPONSES))
        - 1
    )


@pytest.mark.parametrize(
    "prompts, responses, words",
    [
        (["what is <|end|> plus 1?"], ["x"], ["prompts[0]", "<|end|>"]),
        (["ok"], ["the answer<|user|>"], ["responses[0]", "<|user|>"]),
        (["ok"], [""], ["responses[0]", "non-empty"]),
        (["a", "b"], ["x"], ["one response per prompt"]),
        ("ok", ["x"], ["prompts", "list of strings"]),
    ],
)
def test_bad_input_is_refused(tokenizer, prompts, responses, words):
    with pytest.raises((ValueError, TypeError)) as info:
        tokenize_chat(prompts, responses, tokenizer)
    for word in words:
        assert word in str(info.value)


def test_a_conversation_longer_than_the_context_is_refused(tokenizer):
    length = len(tokenizer.encode(chat_prompt(PROMPTS[0]) + RESPONSES[0] + END))
    tokenize_chat(PROMPTS[:1], RESPONSES[:1], tokenizer, n_ctx=length)
    with pytest.raises(ValueError, match=f"responses\\[0\\].*{length} tokens.*n_ctx={length - 1}"):
        tokenize_chat(PROMPTS[:1], RESPONSES[:1], tokenizer, n_ctx=length - 1)


def test_a_tokenizer_without_the_chat_tokens_is_refused():
    plain = BPETokenizer.train("the answer is 7", 260)
    with pytest.raises(ValueError, match="tokenizer.*<\\|user\\|>"):
        tokenize_chat(PROMPTS, RESPONSES, plain)
