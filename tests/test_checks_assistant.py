"""The chapter 9 checkers (`checks.assistant`): the reference passes, valid alternatives pass,
and each catalogue mistake is named (each written out here as a learner would write it)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checking import fails
from torch import nn

from transformer_course import chat, dpo, fine_tuning, logprobs, lora, policy_gradient
from transformer_course.checks.assistant import (
    check_dpo_loss,
    check_group_normalized_rewards,
    check_lora_linear,
    check_masked_mean,
    check_masked_normalize,
    check_policy_gradient_loss,
    check_response_log_probs,
    check_sft_loss,
    check_token_entropy,
    check_tokenize_chat,
)

CHECKS = {
    check_tokenize_chat: (chat.tokenize_chat, "tokenize_chat"),
    check_response_log_probs: (logprobs.response_log_probs, "response_log_probs"),
    check_token_entropy: (logprobs.token_entropy, "token_entropy"),
    check_masked_mean: (logprobs.masked_mean, "masked_mean"),
    check_masked_normalize: (logprobs.masked_normalize, "masked_normalize"),
    check_sft_loss: (fine_tuning.sft_loss, "sft_loss"),
    check_lora_linear: (lora.LoRALinear, "LoRALinear"),
    check_dpo_loss: (dpo.dpo_loss, "dpo_loss"),
    check_group_normalized_rewards: (
        policy_gradient.group_normalized_rewards,
        "group_normalized_rewards",
    ),
    check_policy_gradient_loss: (policy_gradient.policy_gradient_loss, "policy_gradient_loss"),
}


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_reference_passes(check, capsys):
    reference, name = CHECKS[check]
    check(reference)
    assert f"✓ {name} passes every check" in capsys.readouterr().out


@pytest.mark.parametrize("check", CHECKS, ids=lambda check: check.__name__)
def test_blank_fails(check):
    def blank(*args, **kwargs):
        raise NotImplementedError("Exercise 9.x")

    fails(check, blank, "not implemented")


def test_masked_mean_alternative_passes_and_nan_fails(capsys):
    def alternative(x, mask, dim=None):
        mask = mask.to(x.dtype)
        return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)

    check_masked_mean(alternative)
    fails(check_masked_mean, lambda x, m, dim=None: (x * m).sum(dim) / m.sum(dim), "NaN", "0 / 0")


def test_dpo_mistakes_are_named():
    no_ref = lambda pc, pr, rc, rr, beta: -F.logsigmoid(beta * (pc - pr)).mean()
    fails(check_dpo_loss, no_ref, "reference model's log-probs are missing")
    outside = lambda pc, pr, rc, rr, beta: -beta * F.logsigmoid((pc - rc) - (pr - rr)).mean()
    fails(check_dpo_loss, outside, "beta on the wrong side")
    alternative = lambda pc, pr, rc, rr, beta: F.softplus(-beta * ((pc - pr) - (rc - rr))).mean()
    check_dpo_loss(alternative)


def test_advantages_over_the_whole_batch_are_named():
    def whole_batch(rewards, group_size, *, eps=1e-6, normalize_by_std=True):
        advantages = rewards - rewards.mean()
        if normalize_by_std:
            advantages = advantages / (rewards.std() + eps)
        return advantages, rewards

    fails(check_group_normalized_rewards, whole_batch, "whole batch")


def test_policy_gradient_mistakes_are_named():
    reference = policy_gradient.policy_gradient_loss

    def with_max(log_probs, *, kind, old_log_probs=None, clip_range=None, **kw):
        if kind != "grpo_clip":
            return reference(log_probs, kind=kind, **kw)
        a, ratio = kw["advantages"], torch.exp(log_probs - old_log_probs)
        eps = clip_range
        return -torch.maximum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)

    fails(check_policy_gradient_loss, with_max, "max instead of min")

    def detached(log_probs, *, kind, **kw):
        return reference(log_probs.detach(), kind=kind, **kw)

    fails(check_policy_gradient_loss, detached, "no gradient")


def tokenize_variant(labels_shift=1, mask_shift=1, with_end=True, with_prompt=False):
    """`tokenize_chat` as a learner might write it, with one of the catalogue's slips."""

    def tokenize(prompts, responses, tokenizer, *, n_ctx=None):
        reference = chat.tokenize_chat(prompts, responses, tokenizer, n_ctx=n_ctx)
        full = torch.cat([reference["input_ids"][:, :1], reference["labels"]], dim=1)
        in_response = torch.zeros(full.shape, dtype=torch.bool)
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            start = 0 if with_prompt else len(tokenizer.encode(chat.chat_prompt(prompt)))
            stop = start + len(tokenizer.encode(response + chat.END))
            if with_prompt:
                stop += len(tokenizer.encode(chat.chat_prompt(prompt)))
            in_response[i, start : stop if with_end else stop - 1] = True
        return {
            "input_ids": full[:, :-1],
            "labels": full[:, labels_shift : full.shape[1] - 1 + labels_shift],
            "response_mask": in_response[:, mask_shift : full.shape[1] - 1 + mask_shift],
        }

    return tokenize


def test_tokenize_chat_mistakes_are_named():
    check_tokenize_chat(tokenize_variant())  # the variant itself is right
    fails(check_tokenize_chat, tokenize_variant(labels_shift=0), "labels not shifted")
    fails(check_tokenize_chat, tokenize_variant(mask_shift=0), "one position off")
    fails(check_tokenize_chat, tokenize_variant(with_end=False), "end token")
    fails(check_tokenize_chat, tokenize_variant(with_prompt=True), "prompt is given")


def test_tokenize_chat_as_ints_passes_and_accepting_bad_input_fails():
    def as_ints(prompts, responses, tokenizer, *, n_ctx=None):
        batch = chat.tokenize_chat(prompts, responses, tokenizer, n_ctx=n_ctx)
        return {**batch, "response_mask": batch["response_mask"].long()}

    check_tokenize_chat(as_ints)

    def no_refusals(prompts, responses, tokenizer, *, n_ctx=None):
        plain = [p.replace("<|end|>", "") for p in prompts]
        return chat.tokenize_chat(plain, [r or "x" for r in responses], tokenizer)

    fails(check_tokenize_chat, no_refusals, "accepted", "ValueError")


def test_response_log_probs_mistakes_are_named():
    def unshifted(model, input_ids, labels):
        return model(input_ids).float().log_softmax(-1).gather(-1, input_ids[..., None])[..., 0]

    fails(check_response_log_probs, unshifted, "not of input_ids")

    def in_low_precision(model, input_ids, labels):
        log_probs = model(input_ids).log_softmax(-1)
        return log_probs.gather(-1, labels[..., None])[..., 0]

    fails(check_response_log_probs, in_low_precision, "expected float32", "8 bits")

    def upcast_late(model, input_ids, labels):
        return in_low_precision(model, input_ids, labels).float()

    fails(check_response_log_probs, upcast_late, "log-softmax in float32")

    def alternative(model, input_ids, labels):  # cross-entropy is minus the log-prob
        logits = model(input_ids).float()
        return -F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")

    check_response_log_probs(alternative)

    def by_logsumexp(model, input_ids, labels):  # TRL's selective_log_softmax, in float32
        logits = model(input_ids).float()
        return logits.gather(-1, labels[..., None])[..., 0] - logits.logsumexp(-1)

    check_response_log_probs(by_logsumexp)


def test_token_entropy_mistakes_are_named():
    def nan_on_impossible_tokens(logits):
        p = logits.float().softmax(-1)
        return -(p * p.log()).sum(-1)

    fails(check_token_entropy, nan_on_impossible_tokens, "NaN", "0 * -inf")

    def in_bits(logits):
        return logprobs.token_entropy(logits) / torch.log(torch.tensor(2.0))

    fails(check_token_entropy, in_bits, "not log2")

    def not_upcast(logits):
        log_p = logits.log_softmax(-1)
        return -(log_p.exp() * log_p.nan_to_num(neginf=0.0)).sum(-1)

    fails(check_token_entropy, not_upcast, "expected float32", "8 bits")

    def alternative(logits):
        return torch.distributions.Categorical(logits=logits.float()).entropy()

    check_token_entropy(alternative)


def test_masked_normalize_mistakes_are_named():
    fails(
        check_masked_normalize,
        lambda x, mask, dim=None, normalize_constant=1.0: logprobs.masked_mean(x, mask, dim),
        "not by the number of entries",
    )
    fails(
        check_masked_normalize,
        lambda x, mask, dim=None, normalize_constant=1.0: x.sum(dim) / normalize_constant,
        "only the entries where the mask is on",
    )
    fails(
        check_masked_normalize,
        lambda x, mask, dim=None, normalize_constant=1.0: (x * mask).sum(dim) * normalize_constant,
        "not multiply",
    )
    alternative = lambda x, mask, dim=None, normalize_constant=1.0: (
        (x * mask).sum(dim) / normalize_constant
    )
    check_masked_normalize(alternative)


def test_sft_loss_mistakes_are_named():
    def over_the_prompt_too(model, batch, n_response_tokens):
        log_probs = logprobs.response_log_probs(model, batch["input_ids"], batch["labels"])
        return -log_probs.sum() / n_response_tokens

    fails(check_sft_loss, over_the_prompt_too, "summed over the prompt too")

    def own_count(model, batch, n_response_tokens):
        mask = batch["response_mask"]
        return fine_tuning.sft_loss(model, batch, int(mask.sum()))

    fails(check_sft_loss, own_count, "not by this part's own count")

    def alternative(model, batch, n_response_tokens):
        logits, mask = model(batch["input_ids"]).float(), batch["response_mask"]
        return F.cross_entropy(logits[mask], batch["labels"][mask], reduction="sum") / (
            n_response_tokens
        )

    check_sft_loss(alternative)


class LoRAVariant(nn.Module):
    """LoRALinear as a learner might write it, with one of the catalogue's slips."""

    b_init, per_rank, freeze = staticmethod(torch.zeros), True, True

    def __init__(self, base, rank, alpha):
        super().__init__()
        self.base = base.requires_grad_(not self.freeze)
        dtype = base.weight.dtype
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, dtype=dtype) / rank)
        self.lora_B = nn.Parameter(self.b_init(base.out_features, rank, dtype=dtype))
        self.scaling = alpha / rank if self.per_rank else alpha

    def forward(self, x):
        return self.base(x) + self.scaling * (x @ (self.lora_B @ self.lora_A).T)

    merged = lora.LoRALinear.merged


def test_lora_mistakes_are_named():
    check_lora_linear(LoRAVariant)  # another init of A, another order of the products
    fails(check_lora_linear, type("BRandom", (LoRAVariant,), {"b_init": torch.randn}), "B init")
    fails(check_lora_linear, type("NoRank", (LoRAVariant,), {"per_rank": False}), "without /rank")
    fails(check_lora_linear, type("Unfrozen", (LoRAVariant,), {"freeze": False}), "freeze")


def test_tokenize_chat_without_n_ctx_fails():
    def no_n_ctx(prompts, responses, tokenizer):
        return chat.tokenize_chat(prompts, responses, tokenizer)

    fails(check_tokenize_chat, no_n_ctx, "n_ctx", "TypeError")
