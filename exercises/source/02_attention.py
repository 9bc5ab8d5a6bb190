# %% [markdown]
# # Chapter 2 workbook: attention
#
# You will build attention in three steps:
#
# 1. `attention_scores`: every query dotted with every key, scaled by $1/\sqrt{d_\text{head}}$.
# 2. `scaled_dot_product_attention`: a softmax over the keys turns the scores into weights
#    (the *pattern*); the output is the weighted average of the values.
# 3. `MultiHeadAttention`: the initialisation and the forward pass of a TransformerLens-style
#    attention layer with `n_heads` heads.
#
# At the end, a tiny model built around **your** `MultiHeadAttention` learns to reverse a
# sequence, a task no model without attention can do, and you read off the attention pattern
# it learned.
#
# Each check cell compares your code with the course's reference and PyTorch's
# `torch.nn.functional.scaled_dot_product_attention`, and when they differ it tells you which
# classic mistake your output matches. The chapter's book page explains the why.
#
# Shapes follow PyTorch: `(..., pos, d)`. Masks are boolean with **True = may attend**; the
# masking helpers (`masked_softmax`, `fill_masked`) are chapter 3's subject and are given here.

# %% tags=nbval-ignore-output
import math
import time

import einops
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.attention import (
    LayerCache,
    Mask,
    causal_mask,
    fill_masked,
    masked_softmax,
    zero_unseen,
)
from transformer_course.checks.attention import (
    check_attention_scores,
    check_multi_head_attention,
    check_scaled_dot_product_attention,
)
from transformer_course.parts import keep
from transformer_course.runtime import describe_run, seed_everything, upcast

seed_everything(0)
print(describe_run())

# %% [markdown]
# ## Exercise 2.1: `attention_scores`
#
# $$\text{scores}_{ij} = \frac{q_i \cdot k_j}{\sqrt{d_\text{head}}}$$
#
# `q` is `(..., q_pos, d_head)` and `k` is `(..., k_pos, d_head)`; the result is
# `(..., q_pos, k_pos)`, one row per query, whatever the leading (batch, head) dims. float16
# and bfloat16 inputs give **float32** scores: a float16 dot product overflows past 65504.
# `upcast(t)` (given) returns a half-precision tensor as float32 and any other unchanged.

# %% [exercise] transformer_course.attention:attention_scores difficulty=1 importance=5 minutes=5
# hint: Score (i, j) is the dot product of query i with key j: a contraction over `d_head`, scaled
#   by one over the square root of `d_head`. The precision is decided before the product.
# hint: Upcast both inputs first. In an `einops.einsum` pattern, queries keep `q_pos`, keys keep
#   `k_pos`, both share `d_head`, and the leading `...` axes pass through.

# %% [check]
check_attention_scores(attention_scores)
keep(attention_scores)

# %% [markdown]
# ## Exercise 2.2: `scaled_dot_product_attention`
#
# $$\text{Attention}(Q, K, V) = \text{softmax}\left(\frac{QK^\top}{\sqrt{d_\text{head}}}\right)V$$
#
# Return `(out, pattern)`: the pattern `(..., q_pos, k_pos)` holds each query's weights over
# the keys the mask allows (they sum to one; a query with no allowed key gets zeros, never
# NaN), and `out` `(..., q_pos, d_v)` the values averaged with those weights, both in the dtype
# of `q`. Inputs that do not fit together (a `k` whose `d_head` differs from `q`'s, a `v` with
# another number of positions than `k`, a mask that does not broadcast to the scores) are
# refused with a `ValueError` that names them: `validate.attention_inputs(q, k, v, mask)`
# (given) raises it. `masked_softmax(scores, mask)` (given, chapter 3's subject) is a softmax
# over the last dim that ignores the forbidden keys and keeps the scores' dtype.

# %% [exercise] transformer_course.attention:scaled_dot_product_attention difficulty=2 importance=5 minutes=10
# hint: After the input check, three steps: scores, a softmax over the keys (the last dim), a
#   weighted sum of the values.
# hint: Your `attention_scores`, then `masked_softmax` for the pattern; the output contracts the
#   pattern's `k_pos` with the values' `k_pos`. Scores of half-precision inputs are float32:
#   bring the values to the pattern's dtype, and the results back to `q`'s.

# %% [check]
check_scaled_dot_product_attention(scaled_dot_product_attention)
keep(scaled_dot_product_attention)

# %% [markdown]
# Your function agrees with PyTorch's fused kernel, which never materialises the pattern:

# %% [check]
q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 3)
mask = causal_mask(5, 7)
out, pattern = scaled_dot_product_attention(q, k, v, mask)
print(
    "pattern shape:",
    tuple(pattern.shape),
    "| rows sum to one:",
    torch.allclose(pattern.sum(-1), torch.ones(2, 4, 5)),
)
print(
    "same as F.scaled_dot_product_attention:",
    torch.allclose(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), atol=1e-6),
)

# %% [markdown]
# ## Exercise 2.3: `MultiHeadAttention`
#
# The parameters follow TransformerLens: `W_Q`, `W_K`, `W_V` are `(n_heads, d_model, d_head)`,
# `W_O` is `(n_heads, d_head, d_model)`, the biases `b_Q`, `b_K`, `b_V` are `(n_heads, d_head)`
# and `b_O` is `(d_model,)`.
#
# * `reset_parameters`: GPT-2's initialisation, weights from $\mathcal{N}(0, 0.02^2)$ and biases
#   **zero**.
# * `forward`: project `x` to queries and `context` (default `x`) to keys and values, every
#   head at once, and pass each through its hook point. Then run exercise 2.2's attention on
#   every head at once, its scores (with the forbidden ones filled) through `hook_attn_scores`,
#   its pattern through `hook_pattern` and each head's output through `hook_z`, and finally
#   project every head back to `d_model` with `W_O`, summing over heads, plus `b_O`. The
#   shape comments in `__init__` give each hook's layout. Two helpers are yours to write
#   and use: `_project` (the three projections) and `_attend` (the attention itself). Two
#   are given: `_mask` (the mask to apply, causal part included) and `_attend_fused`, which
#   replaces `_attend` with PyTorch's fused kernel when `self.fast_path` is set.
# * `causal=True` hides the keys after each query, on top of `mask` (chapter 6's GPT-2 calls
#   its attention this way).
# * a module cast to float16 or bfloat16 (`.half()`) runs on inputs of its dtype and returns
#   that dtype, its scores computed in float32.
# * `cache` is for chapter 6's KV cache: when one is given, its `extend` method takes this
#   call's keys and values (heads before positions) and returns all the keys and values so
#   far, which the queries then attend to.
#
# The check compares every hook point with the reference, so when something is off it tells
# you the first step that differs.

# %% [exercise] transformer_course.attention:MultiHeadAttention blank=reset_parameters,forward,_project,_attend difficulty=4 importance=5 minutes=40
# hint: `reset_parameters`: weights drawn from a normal with std 0.02, biases zero (a layer built
#   with `bias=False` has no biases to reset).
# hint: `forward`: each projection is one einsum over `d_model` that keeps `head` and `d_head`,
#   plus the bias; the head axis then moves before the positions so heads act as a batch.
# hint: The given `self._mask(mask, causal, q_pos, k_pos, device)` returns the mask to use, its
#   causal part included. Scores: `fill_masked` on exercise 2.1's scores; pattern: a softmax
#   whose forbidden weights are then set to zero, in `v`'s dtype (scores of half-precision
#   inputs are float32).
# hint: `"batch pos d_model, head d_model d_head -> batch pos head d_head"` projects; after
#   attention, `"batch q_pos head d_head, head d_head d_model -> batch q_pos d_model"` with
#   `W_O` projects back and sums the heads.

# %% [check]
check_multi_head_attention(MultiHeadAttention)
keep(MultiHeadAttention)

# %% [markdown]
# With a causal mask, `run_with_cache` shows each head's pattern: a lower triangle whose rows
# sum to one.

# %% [check] tags=nbval-ignore-output
mha = MultiHeadAttention(d_model=32, n_heads=4)
_, cache = mha.run_with_cache(torch.randn(1, 6, 32), mask=causal_mask(6))
print({name: tuple(t.shape) for name, t in cache.items()})
pattern = cache["hook_pattern"][0, 0]
print(pattern.round(decimals=2))
assert (pattern.triu(diagonal=1) == 0).all(), "a lower triangle: no query sees a later key"
assert torch.allclose(pattern.sum(-1), torch.ones(6)), "whose rows sum to one"

# %% [markdown]
# ## Your attention learns to reverse a sequence
#
# Reversing needs attention: output position $i$ must fetch the token at position
# $7 - i$ of an 8-token input. A model that treats each position on its own can only guess, one
# time in ten with 10 possible tokens. The smallest model that can do it: token and position
# embeddings, **your** `MultiHeadAttention` with two heads and no mask (every position may look
# at every other), added to the residual stream, and an unembedding.

# %%
VOCAB, SEQ_LEN = 10, 8


class Reverser(nn.Module):
    """Embed, add one attention layer's output to the residual stream, unembed."""

    def __init__(self, d_model: int = 32, n_heads: int = 2) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.randn(VOCAB, d_model) * 0.1)
        self.W_pos = nn.Parameter(torch.randn(SEQ_LEN, d_model) * 0.1)
        self.attn = MultiHeadAttention(d_model, n_heads)  # yours
        self.W_U = nn.Parameter(torch.randn(d_model, VOCAB) * 0.1)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.W_E[tokens] + self.W_pos

    def forward(self, tokens: Tensor) -> Tensor:
        resid = self.embed(tokens)
        return (resid + self.attn(resid)) @ self.W_U


def reversal_batch(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """`n` random sequences and their reversals."""
    tokens = torch.randint(VOCAB, (n, SEQ_LEN), generator=generator)
    return tokens, tokens.flip(-1)


# %% [check] tags=nbval-ignore-output
torch.manual_seed(0)
model = Reverser()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
batches = torch.Generator().manual_seed(1)
losses = []
start = time.perf_counter()
for step in range(201):
    tokens, target = reversal_batch(64, batches)
    loss = F.cross_entropy(model(tokens).flatten(0, 1), target.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if step % 25 == 0:
        print(f"step {step:3d}  loss {loss.item():.3f}")
print(f"trained in {time.perf_counter() - start:.1f} s")
assert abs(losses[0] - math.log(VOCAB)) < 0.2, "the loss starts at chance, ln 10"
assert max(losses[100:]) < 0.05, "and is almost zero from step 100 on"

# %% [markdown]
# The loss starts at chance, $\ln 10 \approx 2.3$, and drops to almost zero within a few dozen
# steps, once the heads find where to look. On 1,000 sequences it has never seen, with and
# without the attention layer's contribution to the residual stream:

# %% [check] tags=nbval-ignore-output
tokens, target = reversal_batch(1000, torch.Generator().manual_seed(2))
with torch.no_grad():
    with_attention = (model(tokens).argmax(-1) == target).float().mean().item()
    without = ((model.embed(tokens) @ model.W_U).argmax(-1) == target).float().mean().item()
print(f"reversed correctly, with your attention: {with_attention:.0%}")
print(f"without it: {'chance level' if without < 0.2 else f'{without:.0%}'} (chance is 10%)")
assert with_attention > 0.95, "with your attention, the model reverses almost every sequence"
assert without < 0.2, "without it, it is at chance level"

# %% [markdown]
# Your `hook_pattern` shows how. Averaged over those 1,000 sequences, output position $i$ puts
# nearly all its weight on input position $7 - i$: an anti-diagonal, in both heads.

# %% [check] tags=nbval-ignore-output
with torch.no_grad():
    _, cache = model.attn.run_with_cache(model.embed(tokens))
patterns = cache["hook_pattern"].mean(0)  # (head, q_pos, k_pos), averaged over the batch
fig, axes = plt.subplots(1, patterns.shape[0], figsize=(4 * patterns.shape[0], 3.6))
for head, ax in enumerate(axes):
    ax.imshow(patterns[head], cmap="Blues", vmin=0, vmax=1)
    ax.set(title=f"head {head}", xlabel="key (input) position", ylabel="query (output) position")
fig.tight_layout()
plt.show()
mirror = patterns[:, torch.arange(SEQ_LEN), SEQ_LEN - 1 - torch.arange(SEQ_LEN)]
print(f"weight on the mirror position, the least of any query and head: {mirror.min():.2f}")
assert (mirror > 0.8).all(), "every query of every head puts nearly all its weight on its mirror"

# %% [markdown]
# ## Going further
#
# - Concatenating the heads and multiplying by one `(n_heads * d_head, d_model)` matrix gives
#   the same result as the per-head einsum. Check it with
#   `einops.rearrange(W_O, "head d_head d_model -> (head d_head) d_model")`; what goes wrong
#   with `"(d_head head)"`?
# - Time the two paths (`fast_path=False` and `True`) on a `(8, 256, 512)` input with
#   `%timeit`. Where does the difference come from?
