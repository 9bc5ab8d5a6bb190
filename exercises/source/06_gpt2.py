# %% [markdown]
# # Chapter 6 workbook: GPT-2
#
# You will build GPT-2 and train it with a loop of your own:
#
# 1. the token embedding, 2. the position embedding and 3. the unembedding;
# 4. the model that wires them around your chapter 5 blocks;
# 5. the conversion that loads Hugging Face's GPT-2 weights into your model;
# 6. nucleus (top-p) filtering and 7. the sampling loop that turns the model into a writer;
# 8. random batches of text and 9. the validation loss;
# 10. the warmup + cosine learning-rate schedule;
# 11. the training step and 12. the training loop that evaluates and keeps the best model;
# 13. (optional) a KV cache for generation.
#
# At the end your GPT-2 trains on Tiny Shakespeare, and every part of it is yours: the first
# cell loads what you built in chapters 1–5 (tokenizer, attention, masks, layer norm, MLP,
# residual sublayer and block) from the files their workbooks saved and checks each one again;
# a part you have not finished is replaced by the course's, and the table says so. Each check
# cell compares your code with the course's reference on random weights, says what is wrong
# and hints at why, and once it passes saves your part (`keep`).

# %%
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule
from transformers import GPT2Config as HFGPT2Config
from transformers import GPT2LMHeadModel

from transformer_course.checks.gpt2 import (
    check_against_huggingface,
    check_cosine_lr,
    check_embed,
    check_estimate_loss,
    check_generate,
    check_gpt2_forward,
    check_kv_cache,
    check_pos_embed,
    check_sample_batch,
    check_top_p_filter,
    check_train_loop,
    check_train_step,
    check_unembed,
    check_weight_conversion,
)
from transformer_course.parts import keep, keep_model, load_parts, whose_parts
from transformer_course.runtime import describe_run, seed_everything

# Your chapters 1-5 (each checked again) and the course's tools, in this notebook.
load_parts(globals(), chapter=6)
seed_everything(0)
print(describe_run())

# %% [markdown]
# ## Embeddings
#
# GPT-2 reads token ids. The token embedding `W_E` has one row of `d_model` numbers per vocabulary
# entry; looking a token up is indexing. GPT-2 has no sinusoids: the position embedding `W_pos`
# is a second learned table, with one row per position up to `n_ctx`. Both tables are added to
# form the *residual stream*. Unlike the original transformer, GPT-2 does not multiply the token
# embedding by $\sqrt{d_\text{model}}$.

# %% [exercise] transformer_course.gpt2:Embed blank=forward difficulty=1 importance=4 minutes=5
# hint: Row `t` of `W_E` is the vector of token `t`: a lookup is indexing.

# %% [check]
check_embed(Embed)
keep(Embed)

# %% [exercise] transformer_course.gpt2:PosEmbed blank=forward difficulty=1 importance=4 minutes=5
# hint: Only the first `pos` rows of `W_pos` are used, and every sequence of the batch gets the same
#   ones.
# hint: Slice to `tokens.shape[1]`, then repeat over the batch (`einops.repeat`).

# %% [check]
check_pos_embed(PosEmbed)
keep(PosEmbed)

# %% [markdown]
# ## Unembedding
#
# At the end, the residual stream of each position becomes one logit per vocabulary entry:
# `x @ W_U + b_U`. Write `__init__` too: `W_U` is `(d_model, d_vocab)` drawn from
# $\mathcal N(0, \text{init\_range}^2)$, and the bias `b_U` starts at zero.

# %% [exercise] transformer_course.gpt2:Unembed blank=__init__,forward difficulty=1 importance=4 minutes=10
# hint: `__init__`: two parameters, `W_U` `(d_model, d_vocab)` drawn with std `cfg.init_range`, and
#   a zero bias `b_U`.
# hint: `forward` is one matrix product plus the bias.

# %% [check]
check_unembed(Unembed)
keep(Unembed)

# %% [markdown]
# ## Your block
#
# GPT-2's block is the one you wrote in chapter 5 (exercise 5.5), with the decoder's causal
# self-attention and without its cross-attention: `TransformerBlock(..., causal=True,
# cross_attention=False, norm="pre")`. GPT-2 normalises each sublayer's input (pre-LN), as
# your `residual_sublayer` does with `norm="pre"`, and its MLP is your chapter 5 `MLP` with
# `gelu_new`. Nothing to write here: `GPT2.__init__` below builds its blocks from yours.

# %% [markdown]
# ## The whole model
#
# `GPT2.__init__` is given: it builds **your** `Embed`, `PosEmbed`, `n_layers` of **your**
# `TransformerBlock`s, **your** final `LayerNorm` and **your** `Unembed`. Write `forward`: token ids
# in, logits out. Pass the two embeddings through `hook_embed` and `hook_pos_embed`, so
# `run_with_cache` sees them, and apply `self.dropout` to their sum.

# %% [exercise] transformer_course.gpt2:GPT2 blank=forward difficulty=2 importance=5 minutes=15
# hint: Embed the tokens (token plus position, each through its hook), then dropout.
# hint: Run the residual stream through every block in order, then `ln_final`, then `unembed`.

# %% [check]
check_gpt2_forward(GPT2)
keep(GPT2)

# %% [markdown]
# ## Real weights in your model
#
# Hugging Face's `GPT2LMHeadModel` stores GPT-2 in OpenAI's layout, and yours uses
# TransformerLens's names and shapes. Write the conversion from their `state_dict()` to yours:
# a dict from each of your parameter names (`embed.W_E`, `blocks.0.attn.W_Q`, ...; print
# `GPT2(cfg).state_dict().keys()` to see them all) to a tensor of your shape.
#
# Three things to know about their layout. Their `Conv1D` layers store a weight as
# `(d_in, d_out)`: already the layout of your `x @ W` (no transpose, unlike `nn.Linear`).
# Attention keeps queries, keys and values side by side in one `attn.c_attn` matrix
# `(d_model, 3 * d_model)`, and every head's columns together; the output projection
# `attn.c_proj` reads the heads' outputs concatenated. And the language-model head
# `lm_head.weight` `(d_vocab, d_model)` is the token embedding itself (tied weights) and has no
# bias: your `unembed.W_U` is its transpose, and your `unembed.b_U` is zero.
#
# `GPT2.from_huggingface` (in your class above) calls your conversion, so once it passes, the
# next cell compares your whole model with Hugging Face's, stage by stage.

# %% [exercise] transformer_course.gpt2_weights:convert_hf_gpt2_state_dict difficulty=3 importance=4 minutes=30
# docstring: Hugging Face GPT-2 weights (`hf_state_dict`, from a `GPT2LMHeadModel`) under your
#   model's parameter names and shapes, for `n_layers` blocks of `n_heads` heads. Returns a dict
#   that `GPT2.load_state_dict` accepts.
# hint: Print both sides: `hf_model.state_dict()` and `GPT2(cfg).state_dict()`, name and shape.
#   Most block parameters only change name (`ln_1.weight` is your `ln1.w`, `mlp.c_fc.weight` your
#   `mlp.W_in`, ...).
# hint: `c_attn` splits into three equal parts along its output dimension (Q, K, V, in that
#   order); each part's columns are the heads one after another, and `W_O`'s rows likewise.
# hint: `chunk(3, dim=1)` splits `c_attn`; `einops.rearrange(w, "d_model (head d_head) -> head
#   d_model d_head", head=n_heads)` gives `W_Q`'s shape, and `"(head d_head) d_model -> head
#   d_head d_model"` gives `W_O`'s.

# %% [check]
check_weight_conversion(convert_hf_gpt2_state_dict)
keep(convert_hf_gpt2_state_dict)

# %% [check] tags=nbval-ignore-output
torch.manual_seed(0)
hf_config = HFGPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=32, vocab_size=100)
hf_model = GPT2LMHeadModel(hf_config).eval()
yours = GPT2.from_huggingface(hf_model)  # your class, your conversion
tokens = torch.randint(0, hf_config.vocab_size, (2, 12))
check_against_huggingface(yours, hf_model, tokens)

# %% [markdown]
# ## Nucleus (top-p) sampling
#
# `top_k` keeps a fixed number of tokens, whether the model is sure (one token has 95% of the
# mass) or unsure (a hundred tokens have 1% each). Nucleus sampling (Holtzman et al., 2020) keeps
# instead, in each row, the fewest most likely tokens whose probabilities add up to at least
# `top_p`, and forbids the rest (their logits become -inf). The token whose probability carries
# the total past `top_p` stays, so the most likely token is always kept. Return the kept logits
# unchanged and in the original vocabulary order.
#
# For example, with `top_p=0.85` over 8 tokens: a sure row, whose most likely token has
# probability 0.90, keeps that token alone; an unsure row with probabilities 0.25, 0.20, 0.15,
# 0.12, 0.10, 0.08, 0.06 and 0.04 keeps six tokens (the first five add up to 0.82, short of
# 0.85; the sixth takes the total to 0.90). `top_k=3` would keep three tokens of each. `logits`
# has shape `(batch, d_vocab)`, and each row keeps its own nucleus.

# %% [exercise] transformer_course.gpt2:top_p_filter difficulty=3 importance=3 minutes=20
# hint: Sort each row's probabilities (the softmax of the logits) from most to least likely and
#   take their running sum: the nucleus is a prefix of that order.
# hint: A token stays when the mass of the tokens *before* it has not yet reached `top_p`; the
#   first token always stays, as its prefix is empty.
# hint: Decide in sorted order, then carry the decision back to vocabulary order (the sort's
#   indices say where each sorted token came from: `scatter` or indexing), and fill the
#   dropped logits with `-inf`.

# %% [check]
check_top_p_filter(top_p_filter)
keep(top_p_filter)

# %% [markdown]
# ## Sampling
#
# A language model gives a distribution over the next token. To generate text, repeat: feed the
# last `n_ctx` tokens, take the logits of the **last** position, divide them by the temperature
# (below 1 sharpens, above 1 flattens; 0 means always take the most likely token), keep only the
# `top_k` largest if asked, then the `top_p` nucleus (your `top_p_filter`), sample from the
# softmax and append the sample.
#
# Rows of a batch are independent: each keeps its own `top_k` and ends up with its own samples.
# Draw random numbers from `generator` when one is given, so a seeded run repeats exactly.
# Generate in eval mode (no dropout) without gradients, and give the model back its own mode
# afterwards: `evaluating(model)` does all three.

# %% [exercise] transformer_course.gpt2:generate difficulty=3 importance=5 minutes=25
# hint: Each step feeds at most the last `n_ctx` tokens and uses only the logits of the last
#   position.
# hint: The order of the filters matters: temperature first, then `top_k`, then `top_p` (the
#   nucleus is measured on the tempered distribution). Temperature 0 is the argmax.
# hint: `top_k` forbids (sets to -inf) every logit below the k-th largest of its own row
#   (`torch.topk`); then `top_p_filter`; sample with `torch.multinomial(probs, 1,
#   generator=generator)` from the softmax, append, repeat `max_new_tokens` times.

# %% [check]
check_generate(generate)
keep(generate)

# %% [markdown]
# ## Batches of text
#
# A language model trains on windows of its token stream. `sample_batch` draws `batch_size`
# random windows of `n_ctx` tokens from a 1-d tensor `data`, one per row, and returns them
# with the same windows one token later: the targets, so position `i` of a row learns to
# predict token `i + 1`. Every window whose targets still fit in `data` may be drawn, each
# equally often, and every random number comes from `generator` when one is given, so a seeded
# draw repeats exactly.

# %% [exercise] transformer_course.training:sample_batch difficulty=2 importance=4 minutes=15
# hint: A window is `n_ctx` consecutive tokens; its targets are the window one token later,
#   so the last possible window must leave one token after it.
# hint: Draw every row's start at once with `torch.randint`, passing it the generator; its upper
#   bound is exclusive.
# hint: Each start plus `torch.arange(n_ctx)` gives a row of positions to index `data` with.

# %% [check]
check_sample_batch(sample_batch)
keep(sample_batch)

# %% [markdown]
# ## The validation loss
#
# The training loss is measured on batches the model is learning from; to know whether it
# generalises, measure the same loss on text it never trains on. `estimate_loss` averages the
# next-token loss (`lm_loss`) over `n_batches` batches of `data` drawn with your `sample_batch`
# (passing `generator` on), as nanoGPT does. A measurement must not change what it measures:
# dropout off while measuring, no gradients (they would only cost memory), and the model left
# in the mode it was in.

# %% [exercise] transformer_course.training:estimate_loss difficulty=2 importance=4 minutes=15
# docstring: Mean next-token loss of `model` over `n_batches` random batches of `data`, each
#   `batch_size` windows of `n_ctx` tokens, measured in eval mode without gradients; the
#   model's mode is restored afterwards.
# hint: Three concerns: the mode (eval while measuring, then back), gradients (none), and the
#   average (one loss per batch, the mean of them).
# hint: `evaluating(model)` is a context manager that does the first two; each batch comes from
#   `sample_batch(data, batch_size, n_ctx, generator=generator)`, moved to the model's device.

# %% [check]
check_estimate_loss(estimate_loss)
keep(estimate_loss)

# %% [markdown]
# ## Warmup, then a cosine
#
# GPT-2 and nanoGPT train with a learning rate that rises linearly for `warmup_steps` steps
# (Adam's statistics are noisy at first, so the first updates should be small), then falls
# along half a cosine from `lr` down to `min_lr` at `max_steps`, and stays there. Steps count
# from 0, and the first step already trains: during warmup the rate is `lr * (step + 1) /
# warmup_steps`, so step 0 is not wasted at rate 0.
#
# $$\text{lr}(t) = \text{min\_lr} + \tfrac12(\text{lr} - \text{min\_lr})(1 + \cos \pi p),
# \qquad p = \min\left(1, \frac{t - \text{warmup}}{\text{max\_steps} - \text{warmup}}\right)$$

# %% [exercise] transformer_course.training:cosine_lr difficulty=2 importance=4 minutes=10
# docstring: The learning rate at `step` (from 0): a linear warmup to `lr` over `warmup_steps`
#   steps, then half a cosine down to `min_lr` at `max_steps`, and `min_lr` after.
# hint: Two branches: warmup (steps before `warmup_steps`) and decay. Check the ends: the
#   last warmup step and the first decay step are both at `lr`.
# hint: In the decay, the progress `p` goes from 0 at `warmup_steps` to 1 at `max_steps`;
#   clamp it at 1, and guard the division when `max_steps == warmup_steps`.

# %% [check]
check_cosine_lr(cosine_lr)
keep(cosine_lr)

# %% [markdown]
# ## The training step
#
# Training is one step repeated. A step runs the model in train mode (dropout on), measures
# the loss of next-token prediction (`lm_loss`: the cross-entropy of each position's logits
# against the next token), computes fresh gradients of it (the old ones must not add up with
# the new), limits their global norm to `grad_clip` (one bad batch then cannot throw the
# weights far) and lets the optimizer update the weights. Return the loss as a Python number,
# for the log.

# %% [exercise] transformer_course.gpt2:train_step difficulty=2 importance=5 minutes=15
# docstring: One optimizer step of next-token training on `tokens` and their `targets`, with
#   gradient clipping to `grad_clip` (None: no clipping); returns the loss as a float.
# hint: Five things, in an order that matters: the mode, the loss, clearing old gradients,
#   backpropagation, clipping, the update. Clipping must see this step's gradients and come
#   before the optimizer uses them.
# hint: PyTorch has each piece: `Module.train`, `Optimizer.zero_grad`, `Tensor.backward`,
#   `torch.nn.utils.clip_grad_norm_` (skip it when `grad_clip` is None), `Optimizer.step`,
#   and `Tensor.item` for the float.

# %% [check]
check_train_step(train_step)
keep(train_step)

# %% [markdown]
# ## The training loop
#
# Now the loop around your step, as nanoGPT writes it. For each of `max_steps` steps (counted
# from 0): set the optimizer's learning rate to `lr_at(step)` (every parameter group's `"lr"`)
# **before** the step, take a `train_step` on the batch `get_batch(step)`, and record the step,
# its loss and its rate in a `History`. After every `eval_every` steps, and after the last,
# measure `evaluate(model)` (a validation loss), in eval mode without gradients, and record
# `{"step": steps done, "val_loss":
# ...}` in `history.evals`. Keep the best model: wherever the validation loss is the lowest so
# far, record that same `{"step": ..., "val_loss": ...}` in `history.best` (on a tie, the
# earlier or the later evaluation: either is right) and keep a **copy** of the weights in
# `history.best_state` (the model's tensors go on changing; a reference to them would not keep
# anything). After the loop the model is in train mode, as training left it: evaluating
# restores the mode it found. (`History` also has a `grad_norm` list, which chapter 5's
# `training.train` fills; your loop leaves it empty, as `train_step` returns only the loss.)

# %% [exercise] transformer_course.gpt2:train_loop difficulty=3 importance=5 minutes=25
# docstring: Train `model` for `max_steps` steps with `optimizer`, at learning rate
#   `lr_at(step)`, on batches `get_batch(step)`, clipping gradients to `grad_clip`; evaluate
#   with `evaluate(model)` (in eval mode, without gradients) every `eval_every` steps and
#   after the last, and keep the best weights. Returns the `History` (per step: step, train_loss, lr; evals; best, best_state).
# hint: One `for` loop over the steps. Inside: the rate first (a loop over
#   `optimizer.param_groups`), then your `train_step`, then the bookkeeping.
# hint: Evaluate when `(step + 1) % eval_every == 0` or at the last step; compare with
#   `history.best` (empty at first) to decide whether this is the best so far.
# hint: A copy of the weights: `{name: t.detach().clone() for name, t in
#   model.state_dict().items()}`.

# %% [check]
check_train_loop(train_loop)
keep(train_loop)

# %% [markdown]
# ## Your GPT, trained
#
# Everything below runs on your code: your `CharTokenizer` (chapter 1) reads Tiny
# Shakespeare, one token per character; your `GPT2`, built from your embeddings and your
# chapter 5 blocks (with your chapter 2 attention, your chapter 3 masks and your chapter 4
# layer norms), trains with your loop, step, schedule, batches and validation loss, and your
# `generate` writes. The table says whose each part is (the optional KV cache, exercise
# 6.13, comes after). The model is nanoGPT's "baby GPT" for CPUs (4 heads, width 128, a
# context of 64 characters) with 2 layers where it has 4: in a run this short, two layers
# learn more per second than four (the `full` profile trains all 4, for 5,000 steps, on the
# GPU when there is one: `get_device()`, with the batches moved there). A loss
# of ln(65) ≈ 4.17 is a uniform guess over the 65 characters; 400 steps, well under a minute
# on one CPU core, bring the best validation loss to 2.4 or less (the cell asserts it), and the
# samples already take the play's layout: short lines, most of them starting with a capital
# letter.

# %% [check] tags=nbval-ignore-output
import re

from transformer_course.data import load_text
from transformer_course.runtime import by_profile, get_device

text = load_text("tinyshakespeare")
chars = CharTokenizer(text)
data = torch.tensor(chars.encode(text))
split = int(0.9 * len(data))
train_data, val_data = data[:split], data[split:]

device = get_device()
run = by_profile(  # quick: a short run on one CPU core; full: the baby GPT, as nanoGPT trains it
    quick=dict(n_layers=2, steps=400, lr=3e-3, warmup=30, eval_every=100, eval_batches=20),
    full=dict(n_layers=4, steps=5000, lr=1e-3, warmup=100, eval_every=250, eval_batches=50),
)
seed_everything(0)
config = GPT2Config(
    d_model=128, n_layers=run["n_layers"], n_heads=4, d_vocab=chars.vocab_size, n_ctx=64
)
model = set_fast_path(GPT2(config)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=run["lr"], betas=(0.9, 0.99))
whose_parts(globals(), chapter=6)

steps, batches = run["steps"], torch.Generator().manual_seed(1)


def get_batch(step):
    x, y = sample_batch(train_data, 12, 64, generator=batches)
    return x.to(device), y.to(device)


def evaluate(model):
    held_out = torch.Generator().manual_seed(2)  # the same batches at every evaluation
    return estimate_loss(model, val_data, batch_size=12, n_ctx=64, n_batches=run["eval_batches"],
                         generator=held_out)


def lr_at(step):
    return cosine_lr(step, lr=run["lr"], warmup_steps=run["warmup"], max_steps=steps,
                     min_lr=run["lr"] / 10)


history = train_loop(model, optimizer, get_batch, evaluate, max_steps=steps, lr_at=lr_at,
                     eval_every=run["eval_every"])
for record in history.evals:
    print(f"step {record['step']}: val loss {record['val_loss']:.3f}")
model.load_state_dict(history.best_state)  # the best model, not the last
model.cpu()  # back from the GPU, if it trained there: `generate` below draws on the CPU
print(f"best: val loss {history.best['val_loss']:.3f} at step {history.best['step']}")
target = by_profile(quick=2.4, full=1.9)  # a uniform guess is ln 65 = 4.17
assert history.best["val_loss"] <= target, f"your GPT learns: best validation loss <= {target}"
keep_model(model, "chapter_6_gpt2")  # chapter 10 looks inside it

# %% [check] tags=nbval-ignore-output
prompt = torch.tensor([chars.encode("\n")])
sample = generate(model, prompt, 400, temperature=0.8, top_k=10,
                  generator=torch.Generator().manual_seed(3))
written = chars.decode(sample[0].tolist())
print(written)
lines = [line for line in written.splitlines() if line.strip()]
assert len(lines) >= 5, "it writes in lines, as the play does"
assert sum(line[0].isupper() for line in lines) > len(lines) / 2, "most start with a capital"

# %% [markdown]
# ## Going further (optional): a KV cache
#
# This exercise is optional: the chapter is complete without it. `generate` runs the whole
# context again for every new token, although the keys and values of the earlier positions
# never change (a position attends only to itself and to positions before it). Keep them:
# `forward_with_cache` runs only the new tokens through the model. Your attention already
# knows how to use a cache (its `cache` argument, chapter 2), and your block passes it on:
# give each block its own `LayerCache` (chapter 2's, given): `LayerCache(k, v)` holds one
# block's keys and values, `(batch, n_heads, pos, d_head)` tensors in its attributes `k` and
# `v` (`None` for an empty cache), and `cache.extend(k, v)`, which the attention calls, appends
# the new positions' keys and values to them and returns all of them.
# Two things differ from `GPT2.forward`: the new tokens' positions come after the cached ones,
# and the function returns every block's keys and values for the next call, as a list of
# `(keys, values)` pairs (`None` for the first call). The check feeds a prompt, then single
# tokens, then three tokens at once, and compares every logit with `model(all tokens)` (within
# 1e-6 in float64); greedy decoding with your cache must give the tokens it gives without.

# %% [exercise] transformer_course.gpt2:forward_with_cache difficulty=3 importance=2 minutes=25
# hint: Follow `GPT2.forward`: the same embeddings, blocks, final norm and unembedding, with a
#   `LayerCache` per block made from the pairs you are given (empty ones at first).
# hint: The number of cached positions is the length of any cached key tensor along its
#   position dimension (-2); the new tokens' position embeddings start there.
# hint: After the blocks, each `LayerCache` holds that block's longer `k` and `v`: return them
#   as the list of pairs, with the logits.

# %% [check]
check_kv_cache(forward_with_cache)
keep(forward_with_cache)

# %% [check] tags=nbval-ignore-output
# Your trained model, greedy, without and with your cache. A cache holds at most n_ctx positions.
# At 64 positions each step is cheap, so the cache saves little and both timings vary from run
# to run; its gain grows with the context (see "More to try").
import time

prompt = torch.tensor([chars.encode("\n")])
n_new = model.cfg.n_ctx - prompt.shape[1]
started = time.perf_counter()
without_cache = generate(model, prompt, n_new, temperature=0)
seconds_without = time.perf_counter() - started
started = time.perf_counter()
with evaluating(model):
    logits, cache = forward_with_cache(model, prompt)
    with_cache = prompt
    for step in range(n_new):
        next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
        with_cache = torch.cat([with_cache, next_token], dim=1)
        if step < n_new - 1:
            logits, cache = forward_with_cache(model, next_token, cache)
seconds_with = time.perf_counter() - started
print(f"{n_new} greedy tokens: {seconds_without:.3f} s without the cache, "
      f"{seconds_with:.3f} s with it")
print(f"the same tokens: {torch.equal(without_cache, with_cache)}")
assert torch.equal(without_cache, with_cache), "your cache changes no token of greedy decoding"

# %% [markdown]
# With the KV cache written, every part of chapters 1–6 in this notebook is yours:

# %% tags=nbval-ignore-output
whose = whose_parts(globals(), chapter=6)

# %% [markdown]
# ## More to try
#
# - Time the cache on a longer context: a model with `n_ctx=512` generating 500 tokens shows
#   the gap growing with the context, since each step without the cache costs a whole forward
#   pass over it.
# - Train with `top_p=0.9` samples instead of `top_k=10`, or longer: the book page trains the
#   same model for 1,000 steps and plots its loss curve (`python scripts/train_gpt2.py
#   --profile baby` trains the 4-layer baby GPT for 2,000).
