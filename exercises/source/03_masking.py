# %% [markdown]
# # Chapter 3 workbook: masking
#
# You will write the four pieces that decide which keys each query may look at:
#
# 1. `causal_mask`: no token sees the future, also when a KV cache makes keys outnumber queries.
# 2. `padding_mask`: no query sees a padding key.
# 3. `combine_masks`: both rules at once, for masks of different shapes.
# 4. `masked_softmax`: a softmax that ignores forbidden keys and never returns NaN, even for a
#    query with no allowed key, in float32, float16 and bfloat16.
#
# At the end, your four pieces run attention over a left-padded batch, the case where the
# textbook version returns NaN.
#
# Masks are boolean with **True = may attend** (PyTorch's `scaled_dot_product_attention`
# convention) and broadcast against attention scores of shape `(batch, head, q_pos, k_pos)`.
# Each check cell compares your function with the course's reference and, when they differ,
# tells you which classic mistake your output matches.

# %% tags=nbval-ignore-output
import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float, Int
from torch import Tensor

from transformer_course import validate
from transformer_course.attention import Mask, MultiHeadAttention, attention_scores
from transformer_course.checks.masking import (
    check_causal_mask,
    check_combine_masks,
    check_masked_softmax,
    check_padding_mask,
)
from transformer_course.masking import fill_masked
from transformer_course.parts import keep
from transformer_course.runtime import describe_run, seed_everything, upcast

seed_everything(0)
print(describe_run())

# %% [markdown]
# ## Exercise 3.1: `causal_mask`
#
# A token may attend to itself and to every token before it, never to a later one. With as
# many keys as queries (`k_len` left at `None`), query 0 sees key 0, query 1 keys 0 and 1, and
# so on. With `k_len > q_len` the queries are the **last** `q_len` positions of the sequence
# (the keys of the earlier positions come from a cache): the last query sees every key, the
# one before it every key but the last. Build the mask on `device`.
#
# A length that makes no sense is refused with a `ValueError`, not turned into an empty or a
# blind mask: `q_len` must be a positive int and `k_len` at least `q_len`. The given helpers
# take the argument's name first, then its value: `validate.positive_int(name, value)` and
# `validate.at_least(name, value, bound_name, bound)` each raise that error.

# %% [exercise] transformer_course.attention:causal_mask difficulty=2 importance=5 minutes=10
# hint: Draw the mask for `causal_mask(3)` and `causal_mask(2, 4)` on paper: where do the True
#   entries end in each row? With more keys than queries, the triangle slides.
# hint: Query `i` may attend to key `j` exactly when `j <= i + (k_len - q_len)`. `torch.tril`
#   and `Tensor.tril` take a `diagonal=` offset.

# %% [check]
check_causal_mask(causal_mask)
keep(causal_mask)

# %% [markdown]
# ## Exercise 3.2: `padding_mask`
#
# `tokens` is `(batch, k_pos)`; the mask is True at real tokens and False at `pad_id`, shaped
# `(batch, 1, 1, k_pos)` so that it broadcasts over heads and over **queries**: padding is a
# property of keys.

# %% [exercise] transformer_course.masking:padding_mask difficulty=1 importance=4 minutes=5
# hint: Padding is a property of keys: the mask depends on the key position only, and must broadcast
#   over heads and queries.
# hint: Compare `tokens` with `pad_id`, then add the two size-1 axes so the result is `(batch, 1, 1,
#   k_pos)`.

# %% [check]
check_padding_mask(padding_mask)
keep(padding_mask)

# %% [markdown]
# ## Exercise 3.3: `combine_masks`
#
# A decoder batch needs both rules at once: a query may see a key only if the key is not in the
# future **and** not padding. `combine_masks(*masks)` takes any number of masks:
#
# * a key is allowed only where **every** mask allows it;
# * masks of different shapes broadcast against each other: `(q_pos, k_pos)` with
#   `(batch, 1, 1, k_pos)` gives `(batch, 1, q_pos, k_pos)`, one mask per sequence;
# * `None` means "no restriction": skip it, and return `None` when no mask is left;
# * anything but a bool mask is refused with a `ValueError`: a 0/1 float or int mask could mean
#   either convention. `validate.bool_mask(name, mask)` (given) raises one, `name` saying
#   which of the masks it was (`f"masks[{index}]"`);
# * the masks you are given stay as they were.

# %% [exercise] transformer_course.masking:combine_masks difficulty=2 importance=4 minutes=10
# hint: Go through the masks one at a time, narrowing down what is allowed so far. What should
#   "allowed so far" be before you have seen any mask?
# hint: An elementwise AND of bool tensors broadcasts the way arithmetic does, and
#   `torch.broadcast_shapes` tells you whether two shapes fit together.

# %% [check]
check_combine_masks(combine_masks)
keep(combine_masks)

# %% [markdown]
# Combined, the two masks give each sequence of a batch its own lower triangle without the
# padding columns:

# %% [check]
tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]])
print(combine_masks(causal_mask(5), padding_mask(tokens, pad_id=0)).int())

# %% [markdown]
# ## Exercise 3.4: `masked_softmax`
#
# Filling forbidden scores with $-\infty$ before the softmax works until a query has **no**
# allowed key (a padding query under a causal-and-padding mask, for instance): then every entry
# is $-\infty$ and the softmax computes $0/0$ = NaN, which spreads through the whole model in
# one backward pass. Instead:
#
# 1. fill forbidden scores with `fill_masked(scores, mask)` (given): the most negative *finite*
#    value of the dtype, `torch.finfo(scores.dtype).min`; a constant like `-1e9` overflows in
#    float16;
# 2. take the softmax over the last dim;
# 3. set the weights of forbidden keys to exactly zero, so a query with no allowed key gets an
#    all-zero row instead of a uniform one.
#
# With `mask=None` it is a plain softmax. float16 and bfloat16 scores are computed in float32
# (`upcast`, given) and the pattern comes back in the scores' dtype.

# %% [exercise] transformer_course.attention:masked_softmax difficulty=3 importance=5 minutes=15
# hint: Filling with -inf breaks only when a whole row is forbidden: think about what the softmax of
#   a row of equal, very negative numbers is, and what you want instead.
# hint: Fill with `fill_masked` (a finite minimum), take the softmax over the last dim, then force
#   the forbidden weights to exactly zero. `mask=None` means a plain softmax.

# %% [check]
check_masked_softmax(masked_softmax)
keep(masked_softmax)

# %% [markdown]
# The naive version and yours on a row with no allowed key, in float16:

# %% [check] tags=nbval-ignore-output
scores = torch.randn(2, 4, dtype=torch.float16)
mask = torch.tensor([[True, True, False, False], [False, False, False, False]])
naive, yours = scores.masked_fill(~mask, float("-inf")).softmax(-1), masked_softmax(scores, mask)
print("-inf fill:", naive.tolist())
print("yours:    ", yours.tolist())
assert naive[1].isnan().all() and (yours[1] == 0).all(), "no allowed key: NaN with -inf, 0 with yours"
assert torch.allclose(yours[0], naive[0], atol=1e-3), "a row with allowed keys: the same weights"

# %% [markdown]
# ## Your masks on a left-padded batch
#
# Prompts of different lengths are often padded on the **left**, so that they all end at the
# last position. Under a causal mask the first queries of a padded prompt then see nothing but
# padding: no allowed key at all. Here your `causal_mask`, `padding_mask`, `combine_masks` and
# `masked_softmax` run single-head attention (with chapter 2's `attention_scores`) over such a
# batch, and three things must hold:
#
# 1. no NaN, in the output or in any gradient;
# 2. the queries with no allowed key output exactly zero;
# 3. the real positions of the padded prompt get exactly what they would get with no padding
#    at all.

# %% [check]
tokens = torch.tensor([[0, 0, 7, 8, 9], [3, 4, 5, 6, 7]])  # pad_id 0: prompt 0 is left-padded
x = torch.randn(2, 1, 5, 16, dtype=torch.float64, requires_grad=True)  # (batch, head, pos, d)


def attend(x: Tensor, mask: Tensor) -> Tensor:
    return masked_softmax(attention_scores(x, x), mask) @ x


mask = combine_masks(causal_mask(5), padding_mask(tokens, pad_id=0))
out = attend(x, mask)
out.pow(2).sum().backward()
print("1. no NaN in output or gradients:", not (out.isnan().any() or x.grad.isnan().any()).item())
print("2. queries with no allowed key give zeros:", bool((out[0, 0, :2] == 0).all()))
alone = attend(x[:1, :, 2:], causal_mask(3))  # prompt 0 without its padding
print("3. real positions as if unpadded:", torch.allclose(out[:1, :, 2:], alone, atol=1e-12))

# %% [markdown]
# ## Going further
#
# - `MultiHeadAttention` (chapter 2) with `causal_mask(T)`: change the last token of a sequence
#   and check that the outputs at every earlier position stay exactly the same.
# - Append three padding tokens (with random embeddings) to a sequence and extend the padding
#   mask: do the outputs at the real positions change?
# - PyTorch's `F.scaled_dot_product_attention(..., is_causal=True)` aligns its triangle to the
#   *top-left* corner when `q_len != k_len`. Compare it with your `causal_mask(2, 5)`.
