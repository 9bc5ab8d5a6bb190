# %% [markdown]
# # Chapter 6 workbook: GPT-2
#
# You will build the parts of GPT-2 that the earlier chapters did not: the token and position
# embeddings, the unembedding, the MLP with `gelu_new`, the forward pass that wires everything
# into one model, and the sampling loop that turns the model into a text generator.
#
# Each exercise is followed by a check cell. It compares your code with the course's reference
# on random weights and prints `✓ ... passes every check` when you are done, or says what is
# wrong and hints at why.

# %%
from __future__ import annotations

import math

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course.blocks import ACTIVATIONS, TransformerBlock
from transformer_course.checks.gpt2 import (
    check_embed,
    check_generate,
    check_gpt2_forward,
    check_mlp,
    check_pos_embed,
    check_unembed,
)
from transformer_course.gpt2 import GPT2Config, check_tokens
from transformer_course.layernorm import LayerNorm, check_last_dim
from transformer_course.runtime import describe, seed_everything

seed_everything(0)
print(describe())

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
# ## The whole model
#
# `GPT2.__init__` is given: it builds `embed`, `pos_embed`, `n_layers` pre-LN `TransformerBlock`s
# (causal attention, then your MLP), `ln_final` and `unembed`. Write `forward`: embeddings in,
# logits out. Keep the hook points (`hook_embed`, `hook_pos_embed`) so `run_with_cache` works.
#
# The model is built from the course's reference components (the blocks already are), so a slip
# in an earlier exercise does not show up here as a mystery.

# %%
from transformer_course.gpt2 import Embed, PosEmbed, Unembed

# %% [exercise] transformer_course.gpt2:GPT2 blank=forward difficulty=2 importance=5 minutes=15
# hint: Validate the tokens, embed them (token plus position, each through its hook), then dropout.
# hint: Run the residual stream through every block in order, then `ln_final`, then `unembed`.

# %% [check]
check_gpt2_forward(GPT2)

# %% [markdown]
# ## Sampling
#
# A language model gives a distribution over the next token. To generate text, repeat: feed the
# last `n_ctx` tokens, take the logits of the **last** position, divide them by the temperature
# (below 1 sharpens, above 1 flattens; 0 means always take the most likely token), keep only the
# `top_k` largest if asked, sample from the softmax and append the sample.

# %% [exercise] transformer_course.gpt2:generate difficulty=3 importance=5 minutes=25
# hint: Each step feeds at most the last `n_ctx` tokens and uses only the logits of the last
#   position.
# hint: Temperature 0 is the argmax. Otherwise divide the logits by the temperature; with `top_k`,
#   forbid every logit below the k-th largest of its own row.
# hint: Sample with `torch.multinomial` from the softmax, append, repeat `max_new_tokens` times.

# %% [check]
check_generate(generate)

# %% [markdown]
# ## Putting it together
#
# Your model can now generate. Untrained, its samples are noise over the vocabulary; the book
# chapter trains it on Tiny Shakespeare.

# %% [check]
seed_everything(0)
model = GPT2(GPT2Config(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=16))
prompt = torch.tensor([[1, 2, 3]])
print(generate(model, prompt, 10, temperature=0).tolist())
