"""Supervised fine-tuning (`fine_tuning`): gradient accumulation over micro batches gives the
gradient of one large batch (a float64 model; the log-probs are float32 by contract, so within
1e-6 relative), the loss is the response tokens' mean negative
log-likelihood written independently here with `F.cross_entropy`, and `complete` (KV cache)
gives greedy responses token for token equal to chapter 6's `generate` (no cache)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformer_course.assistant_task import pretraining_text, task_splits
from transformer_course.chat import END, chat_prompt, tokenize_chat
from transformer_course.fine_tuning import accuracy, complete, sft_loss, sft_step, task_tokenizer
from transformer_course.gpt2 import generate
from transformer_course.llama import Llama, LlamaConfig

SPLITS = task_splits(0)
PROBLEMS = SPLITS["train"][:7]


@pytest.fixture(scope="module")
def tokenizer():
    return task_tokenizer(pretraining_text(SPLITS["train"] + SPLITS["harder"]), 290)


def _model(tokenizer, dtype=torch.float64):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_vocab=tokenizer.vocab_size,
        n_ctx=48,
        d_mlp=64,
        init_range=0.2,
    )
    return Llama(cfg).to(dtype)


def _batch(tokenizer, problems=PROBLEMS):
    return tokenize_chat([p.prompt for p in problems], [p.response for p in problems], tokenizer)


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_text_and_chat_share_the_answer_tokens():
    # Lines with the answer on its own line, and the chat format, trained on together: the
    # question's and the answer's tokens are the same in both, the newline's place in text
    # taken by <|assistant|> in the chat (as pre-training's knowledge is to carry over).
    problems = SPLITS["train"]
    text = pretraining_text(problems, "\n") + "".join(
        chat_prompt(p.prompt) + p.response + END for p in problems
    )
    tokenizer = task_tokenizer(text, 290)
    problem = problems[0]
    line = tokenizer.encode(pretraining_text([problem], "\n"))
    chat = tokenizer.encode(chat_prompt(problem.prompt) + problem.response + END)
    question = tokenizer.encode(problem.prompt)
    answer = tokenizer.encode(problem.response)
    assert line == question + tokenizer.encode("\n") + answer + tokenizer.encode("\n")
    assert chat[1:-1] == question + [tokenizer.special_tokens["<|assistant|>"]] + answer
    assert all(len(tokenizer.decode([i])) == 1 for i in answer[-len(str(problem.answer)) :])


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_gradient_accumulation_equals_one_large_batch(tokenizer, micro_batch_size):
    batch = _batch(tokenizer)
    model = _model(tokenizer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step keeps the weights
    whole = sft_step(model, optimizer, batch)
    expected = _grads(model)
    part = sft_step(model, optimizer, batch, micro_batch_size=micro_batch_size)
    assert part == pytest.approx(whole, rel=1e-6)
    for got, want in zip(_grads(model), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_sft_loss_is_the_response_cross_entropy(tokenizer):
    batch = _batch(tokenizer)
    model = _model(tokenizer)
    logits = model(batch["input_ids"])
    mask = batch["response_mask"]
    expected = F.cross_entropy(logits[mask], batch["labels"][mask])  # independent: mean over
    got = sft_loss(model, batch, int(mask.sum()))  # the response tokens only
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=1e-6)


def test_complete_with_cache_equals_generate_without(tokenizer):
    model = _model(tokenizer, torch.float32)
    prompts = [p.prompt for p in SPLITS["held_out"][:5]]
    end = tokenizer.special_tokens[END]
    got = complete(model, tokenizer, prompts, max_new_tokens=6)
    for prompt, response in zip(prompts, got):
        ids = torch.tensor([tokenizer.encode(chat_prompt(prompt))])
        full = generate(model, ids, 6, temperature=0)[0, ids.shape[1] :].tolist()
        want = full[: full.index(end) + 1] if end in full else full
        assert response == want


def test_sampling_is_seeded_and_accuracy_is_a_share(tokenizer):
    model = _model(tokenizer, torch.float32)
    prompts = [p.prompt for p in PROBLEMS]
    runs = [
        complete(
            model,
            tokenizer,
            prompts,
            max_new_tokens=5,
            temperature=1.0,
            generator=torch.Generator().manual_seed(1),
        )
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    assert accuracy(model, tokenizer, PROBLEMS) == 0.0  # an untrained model never answers


def test_bad_input_is_refused(tokenizer):
    model = _model(tokenizer)
    with pytest.raises(ValueError, match="micro_batch_size"):
        sft_step(
            model,
            torch.optim.SGD(model.parameters(), lr=0.0),
            _batch(tokenizer),
            micro_batch_size=0,
        )
    with pytest.raises(ValueError, match="max_new_tokens"):
        complete(model, tokenizer, ["What is 1 + 1?"], max_new_tokens=0)
