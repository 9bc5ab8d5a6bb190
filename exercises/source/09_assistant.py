# %% [markdown]
# # Chapter 9 workbook: from a language model to an assistant
#
# Your modern decoder continues text. An assistant answers: given a question in a chat format,
# it replies, and stops. You will build what turns one into the other:
#
# 1. the chat format, its labels and its response mask;
# 2. the log-probability of each token a model was shown, and 3. the entropy of each of its
#    next-token distributions, in float32 whatever the model's dtype;
# 4. the masked mean and 5. the masked sum, over response tokens only;
# 6. the supervised fine-tuning (SFT) loss, whose gradient accumulates over micro batches to
#    the gradient of one large batch;
# 7. LoRA, a frozen layer plus a trainable low-rank update;
# 8. the DPO loss, which learns from a chosen and a rejected response;
# 9. GRPO's group-normalised advantages and 10. the policy-gradient losses, GRPO's clipped
#    surrogate among them.
#
# At the end your chapter 7 decoder, with your AdamW, learns to answer addition questions in
# a fixed format: SFT with your loss, then a few GRPO steps with your advantages and your
# policy-gradient loss, each checked against the course's loops on the same inputs. The first
# cell loads your parts of chapters 1-8.

# %%
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

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
from transformer_course.parts import keep, load_parts, whose_parts
from transformer_course.runtime import describe_run, seed_everything

# Your chapters 1-8 (each checked again) and the course's tools, in this notebook.
load_parts(globals(), chapter=9)
seed_everything(0)
print(describe_run())

# %% [markdown]
# ## The chat format
#
# A conversation is one token sequence: `<|user|>{prompt}<|assistant|>{response}<|end|>`. The
# three markers are *special tokens* of your chapter 1 `BPETokenizer` (train it with
# `special_tokens=CHAT_TOKENS`): each is one id that no text can spell, so a user who types
# `<|end|>` cannot end the conversation. `chat_prompt(prompt)` (given) writes the part before
# the response, `USER + prompt + ASSISTANT`.
#
# A decoder learns to predict each next token, so a row of ids `full` gives `input_ids =
# full[:, :-1]` and `labels = full[:, 1:]`: the label at position `t` is the token after
# `input_ids[t]`. SFT learns only what the assistant says: `response_mask`, aligned with the
# labels, is True where the label is a response token or the end token (the model must learn
# to stop), False on the prompt and the padding.
#
# Write `tokenize_chat(prompts, responses, tokenizer, *, n_ctx=None)`: encode each row's
# `chat_prompt(prompt)` and `response + END` separately (BPE merges must not cross the
# border) and join them; right-pad the rows with the `END` id to the longest; return the dict
# `{"input_ids", "labels", "response_mask"}`, each `(batch, longest - 1)`, the mask bool.
# Refuse, with a `ValueError` naming the row: an empty response, a prompt or response holding
# a special token's text (`_plain(name, text, tokenizer)`, given, does it), a conversation
# longer than `n_ctx` tokens.

# %% [exercise] transformer_course.chat:tokenize_chat difficulty=2 importance=5 minutes=20
# docstring: `{"input_ids", "labels", "response_mask"}` of a batch of conversations: the
#   labels are the input ids shifted left by one, the mask (bool, aligned with the labels) is
#   True where the label is a response token or the row's end token.
# hint: Keep, per row, the full list of ids and where its response starts (the length of
#   the prompt's ids). Build one padded `(batch, longest)` tensor of ids and one boolean tensor
#   that is True on each row's response and end token, then cut both.
# hint: The mask must be aligned with the labels: if `in_response` is True on the positions
#   of `full` that hold response tokens, the mask is `in_response[:, 1:]`, as the labels are
#   `full[:, 1:]`.

# %% [check]
check_tokenize_chat(tokenize_chat)
keep(tokenize_chat)

# %% [markdown]
# ## What a model thinks of its own tokens
#
# Fine-tuning, DPO and GRPO all read one number per token: the log-probability the model gives
# the label, `log p(labels[b, t] | input_ids[b, :t+1])`. Write `response_log_probs(model,
# input_ids, labels)` returning `(batch, seq)` float32 log-probs: `model(input_ids)` gives
# logits `(batch, seq, d_vocab)`. Take the log-softmax in float32 whatever the model's dtype:
# a bfloat16 log-softmax keeps 8 bits, and a sequence's log-probability sums many tokens'.

# %% [exercise] transformer_course.logprobs:response_log_probs difficulty=1 importance=5 minutes=10
# docstring: The log-probability of each label under `model`, float32, `(batch, seq)`.
# hint: `log_softmax` over the vocabulary, then pick each label's entry with `gather` on the
#   last dimension (`labels.unsqueeze(-1)`).

# %% [check]
check_response_log_probs(response_log_probs)
keep(response_log_probs)

# %% [markdown]
# The entropy of a next-token distribution, `H = -sum_v p_v log p_v` in nats, says how sure the
# model is; RL runs watch it fall as the policy settles. Write `token_entropy(logits)` for
# logits `(..., d_vocab)`, returning `(...)` in float32. Some logits may be `-inf` (a token
# that cannot come): its `p` is 0 and its term adds 0, never a NaN.

# %% [exercise] transformer_course.logprobs:token_entropy difficulty=2 importance=3 minutes=10
# docstring: The entropy in nats of each next-token distribution, float32.
# hint: Compute `log p` with `log_softmax` (in float32), never as the log of a probability.
# hint: Where a logit is `-inf`, `log p` is `-inf` and `p log p` is `0 * -inf = NaN`: clamp
#   `log p` to the smallest finite float32 before multiplying, so the term is 0.

# %% [check]
check_token_entropy(token_entropy)
keep(token_entropy)

# %% [markdown]
# ## Sums and means over the response
#
# Losses average over the response tokens only. `masked_mean(x, mask, dim=None)` is the mean of
# `x` over the entries where `mask` (bool or 0/1, the shape of `x`) is on, along `dim` (all of
# them with None). A row whose mask is empty (a response cut to nothing) gives 0: one NaN would
# poison the whole batch's loss and every weight after the step.

# %% [exercise] transformer_course.logprobs:masked_mean difficulty=1 importance=4 minutes=5
# docstring: The mean of `x` where `mask` is on (along `dim`, or over everything); 0 where
#   nothing is on.
# hint: The sum of `x` where the mask is on, divided by the number of entries on, clamped to
#   at least 1 (an empty row sums to 0, and 0 / 1 = 0).

# %% [check]
check_masked_mean(masked_mean)
keep(masked_mean)

# %% [markdown]
# `masked_normalize(x, mask, dim=None, normalize_constant=1.0)` divides the masked sum by a
# constant instead: a loss that does not depend on how many response tokens a row has (Dr.
# GRPO's fixed constant), or, with the number of response tokens of a whole batch, the loss
# of a micro batch whose gradients add up to the batch's (next exercise).

# %% [exercise] transformer_course.logprobs:masked_normalize difficulty=1 importance=3 minutes=5
# docstring: The sum of `x` where `mask` is on (along `dim`, or over everything), divided by
#   `normalize_constant`.
# hint: Zero the entries where the mask is off (`torch.where`, or a product with the mask),
#   sum along `dim`, divide.

# %% [check]
check_masked_normalize(masked_normalize)
keep(masked_normalize)

# %% [markdown]
# ## Supervised fine-tuning
#
# SFT's loss is the negative log-likelihood of the response tokens: the prompt is given, not
# learned. A batch too big for memory is cut into micro batches, each run forward and backward
# before one optimizer step: the gradients add up. They add up to the large batch's gradient
# only if every micro batch divides its sum by the same number, the response tokens of the
# *whole* batch. Write `sft_loss(model, batch, n_response_tokens)`: `batch` is (part of)
# `tokenize_chat`'s dict; return the scalar loss, minus the summed log-probs of the batch's
# response tokens, divided by `n_response_tokens`. Use your `response_log_probs` and
# `masked_normalize`.

# %% [exercise] transformer_course.fine_tuning:sft_loss difficulty=2 importance=5 minutes=10
# docstring: Minus the summed log-probs of `batch`'s response tokens, divided by
#   `n_response_tokens` (the count of the whole batch the step sees).
# hint: The log-probs of the labels, summed where `response_mask` is on, with the sign that
#   makes a likelier response a smaller loss.

# %% [check]
check_sft_loss(sft_loss)
keep(sft_loss)

# %% [markdown]
# ## LoRA
#
# Full fine-tuning trains every weight and keeps AdamW's two running means for each. LoRA (Hu
# et al., 2021) freezes a weight `W` `(out, in)` and trains a low-rank update instead: `W +
# (alpha / rank) B A`, with `A` `(rank, in)` and `B` `(out, rank)`, `rank * (in + out)`
# numbers per matrix. `B` starts at zero, so the model is unchanged before the first step (and
# `A` random, else neither would ever get a gradient); `alpha / rank` keeps the update's size
# the same whatever the rank.
#
# Write `LoRALinear(base, rank, alpha)` around an `nn.Linear` `base`, with PEFT's names:
# `__init__` freezes `base` (keep it as `self.base`), makes the parameters `lora_A` `(rank,
# in_features)` and `lora_B` `(out_features, rank)` in the base weight's dtype and device, and
# sets `self.scaling = alpha / rank`; `forward(x)` returns `base(x) + scaling * x A^T B^T`.
# `_low_rank(d_in, d_out, rank, alpha)` (given) draws `A` as PEFT does and makes `B` zero. The
# given `merged()` folds the update into a plain `nn.Linear` for inference.

# %% [exercise] transformer_course.lora:LoRALinear blank=__init__,forward difficulty=2 importance=4 minutes=15
# docstring __init__: Freeze `base` and make the trainable `lora_A` `(rank, in_features)`,
#   random, and `lora_B` `(out_features, rank)`, zero, and `self.scaling = alpha / rank`.
# docstring forward: The base layer's output plus the scaled low-rank update.
# hint: `base.requires_grad_(False)` freezes the base; `nn.Parameter`s assigned to `self`
#   are what trains. Move them to the base weight's dtype with `.to(base.weight)`.
# hint: Apply the update without forming `B A`: `(x @ A.T) @ B.T` costs `rank * (in + out)`
#   per token, not `in * out`.

# %% [check]
check_lora_linear(LoRALinear)
keep(LoRALinear)

# %% [markdown]
# ## Learning from preferences: DPO
#
# DPO (Rafailov et al., 2023) learns from pairs of responses to one prompt, one chosen over
# the other, with no reward model. The policy's *implicit reward* of a response `y` is `beta
# (log pi(y|x) - log pi_ref(y|x))`: how much likelier the policy makes it than the frozen
# reference (the SFT model) does. The loss is the logistic loss of the chosen response's reward
# beating the rejected one's:
#
# $$\mathcal{L} = -\log \sigma\big(\beta\,[(\log\pi(y_c) - \log\pi_{ref}(y_c)) -
# (\log\pi(y_r) - \log\pi_{ref}(y_r))]\big),$$
#
# averaged over the pairs. Each argument of `dpo_loss(policy_chosen_logps,
# policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta)` is `(batch,)`: a
# response's log-probs summed over its tokens. Without the reference, the policy could raise
# its reward by raising every log-prob; `beta > 0` sets how far from it the policy may go.

# %% [exercise] transformer_course.dpo:dpo_loss difficulty=2 importance=4 minutes=10
# docstring: The mean DPO loss of a batch of pairs from the policy's and the reference's
#   sequence log-probs.
# hint: `F.logsigmoid` is the stable `log sigmoid`. Check the arguments with
#   `_sequence_logps(...)` and `validate.number("beta", ...)` (given).

# %% [check]
check_dpo_loss(dpo_loss)
keep(dpo_loss)

# %% [markdown]
# ## Reinforcement learning from a verifiable reward: GRPO
#
# When a program can check an answer, the model can learn from its own attempts. GRPO (Shao et
# al., 2024) samples a *group* of `group_size` responses per prompt and scores each; a
# response's *advantage* is its reward minus its group's mean, divided by the group's std
# (plus `eps`; unbiased, as `torch.std`), or not divided (Dr. GRPO drops it): a response is
# good if it beat its siblings, whatever the prompt's difficulty. No value model is needed.
#
# Write `group_normalized_rewards(rewards, group_size, *, eps=1e-6, normalize_by_std=True)`
# for `rewards` `(rollouts,)`, whose consecutive groups of `group_size` answer one prompt;
# return `(advantages, raw_rewards)`. Refuse a `group_size` that does not divide the rollouts.

# %% [exercise] transformer_course.policy_gradient:group_normalized_rewards difficulty=2 importance=4 minutes=10
# docstring: `(advantages, raw_rewards)`: each reward minus its group's mean (divided by the
#   group's std plus `eps` with `normalize_by_std`); groups are consecutive.
# hint: `rewards.view(-1, group_size)` puts one group per row: its mean and std are over the
#   last dimension (`keepdim=True` to broadcast back).

# %% [check]
check_group_normalized_rewards(group_normalized_rewards)
keep(group_normalized_rewards)

# %% [markdown]
# The policy-gradient loss, per token of a response (reduce it with `masked_mean` over the
# response), in three kinds:
#
# - `"no_baseline"`: `-reward * log_prob`, REINFORCE with each row's raw reward;
# - `"reinforce_with_baseline"`: `-advantage * log_prob`, the group's mean as the baseline;
# - `"grpo_clip"`: several steps on one batch of rollouts let the policy drift from the one
#   that sampled them, so each token is weighed by `ratio = exp(log_probs - old_log_probs)`
#   and, as in PPO, clipped: `-min(ratio A, clip(ratio, 1 - clip_range, 1 + clip_range) A)`.
#   `old_log_probs` have no gradient; `log_probs` must keep theirs through the ratio. Where
#   the clip binds, the token's gradient is zero: it has moved far enough.
#
# `policy_gradient_loss(log_probs, *, kind, rewards=None, advantages=None, old_log_probs=None,
# clip_range=None)` takes exactly the arguments its kind needs (`POLICY_GRADIENT_KINDS`,
# given, lists them) and refuses the others; rewards and advantages are one per row, `(batch,)`
# or `(batch, 1)`.

# %% [exercise] transformer_course.policy_gradient:policy_gradient_loss difficulty=3 importance=5 minutes=20
# docstring: The per-token loss `(batch, seq)` of one of the three kinds (see above).
# hint: Turn a reward or advantage per row into `(batch, 1)` (`_per_row`, given), so that it
#   broadcasts over the row's tokens.
# hint: For the clipped kind: `torch.minimum(ratio * A, ratio.clamp(1 - eps, 1 + eps) * A)`,
#   negated. Check `clip_range` is in (0, 1) and `old_log_probs` has `log_probs`' shape.

# %% [check]
check_policy_gradient_loss(policy_gradient_loss)
keep(policy_gradient_loss)

# %% [markdown]
# ## Your decoder becomes an assistant
#
# Everything below is yours: your `BPETokenizer` (chapter 1, each digit its own token:
# `DIGITS_APART`, so that numbers are spelled digit by digit), your `Llama` (chapter 7) and
# your `AdamW`, your chat format and SFT loss. The task: addition questions `"What is 3 + 5?"`
# with operands below 10, answered `"the answer is 8"`; 80 questions to train on, 20 held out
# (`task_splits`, seeded). The model starts from random weights, small enough for a CPU: width
# 32, 2 layers.
#
# First a check that your parts make the course's step: the gradient of your SFT loss,
# accumulated over two micro batches of 8 conversations, is the gradient the course's
# `sft_step` takes on all 16 at once (float32: within 1e-5 of the largest). Then 120 steps
# with your AdamW: the cell asserts that the loss falls below a fifth of where it started
# and that, greedy, the model answers at least 80% of the held-out questions in the answer
# format (over three seeds: losses from about 5.6 to 0.23-0.30, every answer in the format).
# The right number is harder: the cell prints the accuracy (20% over those seeds).

# %% [check] tags=nbval-ignore-output
import matplotlib.pyplot as plt

splits = task_splits(0, max_operand=10, harder_max_operand=15)
train, held_out = splits["train"], splits["held_out"]
tokenizer = BPETokenizer.train(
    pretraining_text(train + splits["harder_train"]),
    300,
    pattern=DIGITS_APART,
    special_tokens=CHAT_TOKENS,
)
seed_everything(0)
model = Llama(
    LlamaConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_vocab=tokenizer.vocab_size,
                n_ctx=32, d_mlp=64)
)
batches = torch.Generator().manual_seed(1)


def sft_batch(size=16):
    """A random batch of training questions with their answers, in the chat format."""
    pick = torch.randint(len(train), (size,), generator=batches).tolist()
    return tokenize_chat([train[i].prompt for i in pick], [train[i].response for i in pick],
                         tokenizer)


def your_sft_step(model, optimizer, batch, micro_batch_size=8):
    """One step of your loss, its gradient accumulated over micro batches."""
    n = int(batch["response_mask"].sum())
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for start in range(0, batch["input_ids"].shape[0], micro_batch_size):
        loss = sft_loss(model, {k: v[start:start + micro_batch_size] for k, v in batch.items()}, n)
        loss.backward()
        total += loss.item()
    optimizer.step()
    return total


batch, course = sft_batch(), copy.deepcopy(model)
your_sft_step(model, torch.optim.SGD(model.parameters(), lr=0.0), batch)  # lr 0: weights kept
sft_step(course, torch.optim.SGD(course.parameters(), lr=0.0), batch)
for yours, theirs in zip(model.parameters(), course.parameters()):
    scale = theirs.grad.abs().max().item()
    assert (yours.grad - theirs.grad).abs().max() <= 1e-5 * scale + 1e-8, "the course's step"

optimizer = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.0)
model.train()
losses = [your_sft_step(model, optimizer, sft_batch()) for _ in range(120)]
model.eval()
answers = complete(model, tokenizer, [p.prompt for p in held_out], max_new_tokens=8)
scores = [reward(response_text(tokenizer, r), p.answer) for r, p in zip(answers, held_out)]
in_format = sum(s["format_reward"] for s in scores) / len(scores)
right = sum(s["reward"] for s in scores) / len(scores)
print(f"SFT loss {losses[0]:.2f} -> {sum(losses[-10:]) / 10:.2f}; held out: {in_format:.0%} in "
      f"the answer format, {right:.0%} right")
assert sum(losses[-10:]) / 10 < losses[0] / 5, "your SFT loss falls"
assert in_format >= 0.8, "the model answers in the format"

# %% [markdown]
# ### A few GRPO steps
#
# Now the model learns from its own attempts. Each step samples 8 responses to each of 4
# training questions (temperature 1, with the course's `sample_rollouts`, which generates with
# chapter 7's KV cache), scores them with the task's `reward` (1 for the right number in the
# format, else 0), and takes 2 steps of your clipped loss on that batch: your advantages, your
# log-probs, your `policy_gradient_loss`, averaged over each response's tokens with your
# `masked_mean`, then over the responses.
#
# Two claims, asserted: the first update's gradient is the one the course's `grpo_update`
# takes on the same rollouts (float32: within 1e-4 of each weight's largest); and the
# surrogate loss on each step's rollouts, 0 before the updates (the ratio is 1 and each
# group's advantages sum to 0), is below 0 after them on average over the steps whose groups
# are not all alike: the responses that beat their siblings became likelier (over three seeds
# every step's was, from -0.004 to -0.018). The learning rate is small (5e-4), so that
# AdamW's first steps, about the learning rate in every weight whatever its gradient, do not
# overshoot. Reward per step is printed, not asserted: 4 steps are too few to move it surely.

# %% [check] tags=nbval-ignore-output
rollouts_seed, group_size = torch.Generator().manual_seed(2), 8


def your_grpo_loss(policy, batch, advantages, old_log_probs):
    """Your clipped surrogate, per response its tokens' mean, then the mean over responses."""
    log_probs = response_log_probs(policy, batch["input_ids"], batch["labels"])
    per_token = policy_gradient_loss(log_probs, kind="grpo_clip", advantages=advantages,
                                     old_log_probs=old_log_probs, clip_range=0.2)
    return masked_mean(per_token, batch["response_mask"], dim=1).mean()


optimizer = AdamW(model.parameters(), lr=5e-4, betas=(0.9, 0.99), weight_decay=0.0)
rewards, surrogate = [], []
for step in range(4):
    pick = torch.randint(len(train), (4,), generator=batches).tolist()
    rollouts = sample_rollouts(model, tokenizer, [train[i] for i in pick], group_size,
                               max_new_tokens=8, generator=rollouts_seed)
    batch = rollouts["batch"]
    advantages, raw = group_normalized_rewards(rollouts["rewards"], group_size)
    with torch.no_grad():
        old_log_probs = response_log_probs(model, batch["input_ids"], batch["labels"])
    if step == 0:
        course = copy.deepcopy(model)
        sgd = torch.optim.SGD(course.parameters(), lr=0.0)
        grpo_update(course, sgd, batch, advantages, old_log_probs, clip_range=0.2)
        model.zero_grad(set_to_none=True)
        your_grpo_loss(model, batch, advantages, old_log_probs).backward()
        for yours, theirs in zip(model.parameters(), course.parameters()):
            if theirs.grad is not None:
                scale = theirs.grad.abs().max().item()
                gap = (yours.grad - theirs.grad).abs().max().item()
                assert gap <= 1e-4 * scale + 1e-8, "the course's GRPO update"
    model.train()
    for _ in range(2):
        loss = your_grpo_loss(model, batch, advantages, old_log_probs)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        after = your_grpo_loss(model, batch, advantages, old_log_probs).item()
    rewards.append(raw.mean().item())
    if advantages.abs().max() > 0:
        surrogate.append(after)
    print(f"GRPO step {step}: mean reward {rewards[-1]:.2f}, surrogate after the updates "
          f"{after:.4f}")
assert surrogate, "some group had responses of different rewards"
assert sum(surrogate) < 0, "the updates raised the responses that beat their group"

figure, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
left.plot(losses)
left.set(xlabel="SFT step", ylabel="loss (nats per response token)", yscale="log")
right.plot(rewards, "o-")
right.set(xlabel="GRPO step", ylabel="mean reward of the rollouts", ylim=(0, 1))
plt.show()

# %% [markdown]
# The table of your parts, chapters 1 to 9:

# %% tags=nbval-ignore-output
whose = whose_parts(globals(), chapter=9)

# %% [markdown]
# ## More to try
#
# - Give the model LoRA instead of full fine-tuning: `inject_lora(model, rank=4, alpha=8)`
#   wraps every attention and MLP weight; count the parameters that train, and the bytes of
#   AdamW's state, against full fine-tuning.
# - Build preference pairs from the SFT model's own samples (`preference_pairs`), and train
#   with your `dpo_loss` (the course's `dpo_train` shows the loop): watch the implicit reward
#   margin grow.
# - Run GRPO for more steps on the harder split (`splits["harder_train"]`, operands up to 14),
#   and plot the held-out accuracy and the entropy of the responses (`token_entropy`).
