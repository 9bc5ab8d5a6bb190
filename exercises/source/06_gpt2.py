# %% [markdown]
# # Chapter 6 workbook: GPT-2
#
# You will build GPT-2 out of your own parts: the token and position embeddings, the
# unembedding, the MLP with `gelu_new`, the pre-LN transformer block, the model that wires them
# together, and the sampling loop that turns the model into a text generator. Then you load
# GPT-2-shaped Hugging Face weights into *your* model and match its outputs component by
# component, write the training step and the batches it trains on, and train your model on
# Tiny Shakespeare. Attention (chapter 2) and layer norm (chapter 4) come from the course
# package. An optional last exercise adds a KV cache to generation.
#
# Each exercise is followed by a check cell. It compares your code with the course's reference
# on random weights and prints `✓ ... passes every check` when you are done, or says what is
# wrong and hints at why.

# %%
from __future__ import annotations

import math
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

from transformer_course import validate
from transformer_course.attention import (
    LayerCache,
    MultiHeadAttention,
    scaled_dot_product_attention,
    set_fast_path,
)
from transformer_course.blocks import ACTIVATIONS, residual_sublayer
from transformer_course.checks.gpt2 import (
    check_against_huggingface,
    check_embed,
    check_generate,
    check_gpt2_forward,
    check_kv_cache,
    check_mlp,
    check_pos_embed,
    check_sample_batch,
    check_top_p_filter,
    check_train_step,
    check_transformer_block,
    check_unembed,
)
from transformer_course.gpt2 import GPT2Config, KVCache, TiedUnembed
from transformer_course.gpt2_weights import convert_hf_gpt2_state_dict
from transformer_course.layernorm import LayerNorm
from transformer_course.masking import causal_mask
from transformer_course.runtime import describe_run, evaluating, seed_everything
from transformer_course.training import lm_loss

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

# %% [exercise] transformer_course.gpt2:PosEmbed blank=forward difficulty=1 importance=4 minutes=5
# hint: Only the first `pos` rows of `W_pos` are used, and every sequence of the batch gets the same
#   ones.
# hint: Slice to `tokens.shape[1]`, then repeat over the batch (`einops.repeat`).

# %% [check]
check_pos_embed(PosEmbed)

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

# %% [markdown]
# ## The MLP
#
# Each block's MLP widens every position to `d_mlp = 4 * d_model`, applies GPT-2's activation
# `gelu_new` (the tanh approximation of GELU), and projects back. `ACTIVATIONS[self.act_fn]`
# is the activation function.

# %% [exercise] transformer_course.blocks:MLP blank=forward difficulty=2 importance=4 minutes=10
# hint: Widen to `d_mlp`, apply the activation, project back to `d_model`; biases on both
#   projections.
# hint: `hook_pre` sees the widened pre-activation, `hook_post` the activation's output.
#   `ACTIVATIONS[self.act_fn]` is the activation function.

# %% [check]
check_mlp(MLP)

# %% [markdown]
# ## The transformer block
#
# A block reads the residual stream and adds two things to it: what causal self-attention
# finds, then what the MLP computes. GPT-2 normalises each sublayer's **input** (pre-LN) and
# leaves the stream itself alone; the original transformer normalised **after** each sum
# (post-LN). `self.norm` says which. Chapter 5's `residual_sublayer` (imported above) wires one
# sublayer either way, with its dropout and its output hook; chapter 5's decoder also adds a
# cross-attention sublayer, which GPT-2 does not have (`cross_attention=False`, the default).
# Attention is causal here (`self.causal`): pass it on with `causal=...` (on the fast path
# PyTorch's fused kernel then hides the future without building a mask), along with the
# optional `mask` you are given. Pass the stream through the hook points in the order their
# comments in `__init__` give.
#
# `__init__` builds the block from chapter 2's `MultiHeadAttention`, chapter 4's `LayerNorm`
# and **your** `MLP` from above.

# %% [exercise] transformer_course.blocks:TransformerBlock blank=forward difficulty=3 importance=5 minutes=25
# hint: Two sublayers, each one `residual_sublayer` call: attention with `ln1`, then the MLP
#   with `ln2`. Its `sublayer` argument is any function of one tensor.
# hint: Attention needs more than one argument: wrap it, e.g. in a small local function that
#   calls `self.attn` with the mask and `causal=self.causal`.
# hint: Hooks in order: `hook_resid_pre` on the input, `hook_resid_mid` between the sublayers,
#   `hook_resid_post` on the output; `residual_sublayer` feeds `hook_attn_out` and
#   `hook_mlp_out` through its `hook_out` argument.

# %% [check]
check_transformer_block(TransformerBlock)

# %% [markdown]
# ## The whole model
#
# `GPT2.__init__` is given: it builds **your** `Embed`, `PosEmbed`, `n_layers` of **your**
# `TransformerBlock`s, a final `LayerNorm` and **your** `Unembed`. Write `forward`: token ids
# in, logits out. Pass the two embeddings through `hook_embed` and `hook_pos_embed`, so
# `run_with_cache` sees them, and apply `self.dropout` to their sum.

# %% [exercise] transformer_course.gpt2:GPT2 blank=forward difficulty=2 importance=5 minutes=15
# hint: Validate the tokens, embed them (token plus position, each through its hook), then dropout.
# hint: Run the residual stream through every block in order, then `ln_final`, then `unembed`.

# %% [check]
check_gpt2_forward(GPT2)

# %% [markdown]
# ## Real weights in your model
#
# `GPT2.from_huggingface` (part of the class above) copies a Hugging Face `GPT2LMHeadModel`'s
# weights into a new `GPT2`, transposing and splitting them into TransformerLens's layout. The
# class it builds is **yours**, so if your model reproduces Hugging Face's outputs, every part
# you wrote is GPT-2's. The course runs offline, so the weights here are random, but the model
# has GPT-2's exact architecture (at a smaller width and depth, to run in seconds). The check
# compares the two models stage by stage and names the first one that differs.

# %% [check] tags=nbval-ignore-output
torch.manual_seed(0)
hf_config = HFGPT2Config(n_embd=64, n_layer=3, n_head=4, n_positions=32, vocab_size=100)
hf_model = GPT2LMHeadModel(hf_config).eval()
yours = GPT2.from_huggingface(hf_model)
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

# %% [exercise] transformer_course.gpt2:top_p_filter difficulty=3 importance=3 minutes=20
# hint: Sort each row's probabilities (the softmax of the logits) in descending order and take
#   their running sum.
# hint: A token is dropped when the mass *before* it already reaches `top_p`:
#   `cumsum - probs >= top_p`. Then put the mask back in vocabulary order with `scatter`.

# %% [check]
check_top_p_filter(top_p_filter)

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

# %% [exercise] transformer_course.gpt2:generate difficulty=3 importance=5 minutes=25
# hint: Each step feeds at most the last `n_ctx` tokens and uses only the logits of the last
#   position.
# hint: Temperature 0 is the argmax. Otherwise divide the logits by the temperature; with `top_k`,
#   forbid every logit below the k-th largest of its own row; with `top_p`, apply `top_p_filter`.
# hint: Sample with `torch.multinomial(probs, 1, generator=generator)` from the softmax, append,
#   repeat `max_new_tokens` times.

# %% [check]
check_generate(generate)

# %% [markdown]
# ## The training step
#
# Training is one step repeated: put the model in train mode (dropout on), compute the loss of
# next-token prediction (`lm_loss`: cross-entropy of each position's logits against the next
# token), clear the old gradients, backpropagate, clip the gradients' global norm to
# `grad_clip` (one bad batch then cannot throw the weights far), and let the optimizer update.
# Return the loss as a Python float, for the log.

# %% [exercise] transformer_course.gpt2:train_step difficulty=2 importance=5 minutes=15
# hint: The order is: `model.train()`, loss, `optimizer.zero_grad()`, `loss.backward()`, clip,
#   `optimizer.step()`.
# hint: `torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)` clips in place; skip it
#   when `grad_clip` is None. Return `loss.item()`.

# %% [check]
check_train_step(train_step)

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

# %% [markdown]
# ## Your GPT, trained
#
# Everything below runs on your code: your `GPT2` (built from your embeddings, blocks and
# unembedding), your `sample_batch`, your `train_step` and your `generate`. The data is Tiny
# Shakespeare, one token per
# character (the course's `CharTokenizer`), and the model is nanoGPT's "baby GPT" for CPUs: 4
# layers, 4 heads, width 128, a context of 64 characters. Each step trains on 12 random windows
# of the text; every few hundred steps the loss on held-out text (the last 10%) is measured.
# A loss of ln(65) ≈ 4.17 is a uniform guess over the 65 characters; a couple of minutes of CPU
# training bring it near 2, where the samples take Shakespeare's layout: names, then lines.

# %% [check] tags=nbval-ignore-output
from transformer_course.data import load_text
from transformer_course.runtime import by_profile
from transformer_course.tokenization import CharTokenizer
from transformer_course.training import estimate_loss

text = load_text("tinyshakespeare")
chars = CharTokenizer(text)
data = torch.tensor(chars.encode(text))
split = int(0.9 * len(data))
train_data, val_data = data[:split], data[split:]

seed_everything(0)
config = GPT2Config(d_model=128, n_layers=4, n_heads=4, d_vocab=chars.vocab_size, n_ctx=64)
model = set_fast_path(GPT2(config))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
batches = torch.Generator().manual_seed(1)
steps, losses = by_profile(quick=1200, full=5000), []
for step in range(steps):
    tokens, targets = sample_batch(train_data, 12, 64, generator=batches)
    losses.append(train_step(model, optimizer, tokens, targets))
    if (step + 1) % 400 == 0:
        val = estimate_loss(model, val_data, batch_size=12, n_ctx=64, n_batches=50,
                            generator=torch.Generator().manual_seed(2))
        print(f"step {step + 1}: train loss {sum(losses[-100:]) / 100:.3f}, val loss {val:.3f}")

# %% [check] tags=nbval-ignore-output
prompt = torch.tensor([chars.encode("\n")])
sample = generate(model, prompt, 400, temperature=0.8, top_k=10,
                  generator=torch.Generator().manual_seed(3))
print(chars.decode(sample[0].tolist()))

# %% [markdown]
# ## Going further (optional): a KV cache
#
# This exercise is optional: the chapter is complete without it. `generate` runs the whole
# context again for every new token, although the keys and values of the earlier positions
# never change (a position attends only to itself and to positions before it). Keep them:
# `forward_with_cache` runs only the new tokens through the model, reading every block's earlier
# keys and values from the cache and appending the new ones. Three things differ from
# `GPT2.forward`: the new tokens' positions come after the cached ones, attention uses the
# cached keys and values followed by the new ones, and the mask has one row per new token and
# one column per key (chapter 3's `causal_mask(q_len, k_len)` aligns the last query with the
# last key). Write attention out from the block's parameters (`W_Q`, `b_Q`, ..., `W_O`, `b_O`)
# with chapter 2's `scaled_dot_product_attention`. The check feeds a prompt, then single
# tokens, then three tokens at once, and compares every logit with `model(all tokens)`
# (within 1e-6 in float64); greedy decoding with your cache must give the tokens it gives
# without.

# %% [exercise] transformer_course.gpt2:forward_with_cache difficulty=4 importance=2 minutes=40
# hint: Follow `GPT2.forward`, block by block, with attention written out: the cache changes
#   which positions the new tokens get and which keys and values they attend to.
# hint: The number of cached positions is the length of any cached key tensor along its position
#   dimension; the new tokens' position embeddings start there.
# hint: Concatenate along the position dimension before attending, and return every block's
#   longer `(keys, values)` pair.

# %% [check]
check_kv_cache(forward_with_cache)

# %% [check] tags=nbval-ignore-output
# Your trained model, greedy, without and with your cache. A cache holds at most n_ctx positions.
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

# %% [markdown]
# ## More to try
#
# - Time the cache on a longer context: a model with `n_ctx=512` generating 500 tokens shows
#   the gap growing with the context, since each step without the cache costs a whole forward
#   pass over it.
# - Train with `top_p=0.9` samples instead of `top_k=10`, or longer: the book page trains the
#   same model for 2,000 steps and plots its loss curve.
