# %% [markdown]
# # Chapter 4 workbook: layer norm
#
# You will implement the forward pass of two normalisation layers:
#
# 1. `LayerNorm`: subtract each vector's mean, divide by its standard deviation (with `eps`
#    inside the square root), then apply a learned scale `w` and shift `b`.
# 2. `RMSNorm`: divide each vector by its root mean square, then scale by `w`.
#
# Both normalise over the **last** dimension (`d_model`) only, so every token of every sequence
# is normalised on its own. Each check cell compares your module with PyTorch's
# `torch.nn.functional.layer_norm` / `rms_norm` on random inputs and, when they differ, tells
# you which classic mistake your output matches. The chapter's book page explains the why.

# %% tags=nbval-ignore-output
import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from transformer_course.checks.layernorm import check_layernorm, check_rmsnorm
from transformer_course import validate
from transformer_course.masking import upcast
from transformer_course.runtime import describe, seed_everything

seed_everything(0)
print(describe())

# %% [markdown]
# ## Exercise 4.1: `LayerNorm.forward`
#
# For each vector $x \in \mathbb{R}^{d}$ (the last dimension of the input):
#
# $$\mu = \frac{1}{d}\sum_i x_i, \qquad \sigma^2 = \frac{1}{d}\sum_i (x_i - \mu)^2, \qquad
# y = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \odot w + b$$
#
# Note the $\frac{1}{d}$ in the variance (not $\frac{1}{d-1}$) and where $\epsilon$ sits. Keep the
# two hook points: pass the standard deviation through `self.hook_scale` and the normalised
# vector (before `w` and `b`) through `self.hook_normalized`. Start with
# `validate.last_dim(x, self.d_model)`, which raises a clear error for an input of the wrong size.

# %% [exercise] transformer_course.layernorm:LayerNorm blank=forward difficulty=2 importance=5 minutes=15
# hint: Every statistic is over the last dimension only, with `keepdim=True` so it broadcasts back.
# hint: The variance is the mean of squared deviations (divide by `d_model`, not `d_model - 1`) and
#   eps goes inside the square root. `hook_scale` gets the standard deviation, `hook_normalized`
#   the normalised vector before `w` and `b`.

# %% [check]
check_layernorm(LayerNorm)

# %% [markdown]
# Each normalised vector has mean 0 and standard deviation 1 before the learned scale and shift,
# and the module gives the same numbers as PyTorch's `nn.LayerNorm` (whose `weight` and `bias`
# are our `w` and `b`):

# %% [check]
x = 5 + 3 * torch.randn(2, 4, 8)
ln = LayerNorm(8)
y = ln(x)
print("mean of each vector:", y.mean(-1).abs().max().item() < 1e-6)
print("std of each vector: ", ((y.var(-1, unbiased=False) - 1).abs() < 1e-3).all().item())
print("same as nn.LayerNorm:", torch.allclose(y, nn.LayerNorm(8)(x), atol=1e-6))

# %% [markdown]
# ## Exercise 4.2: `RMSNorm.forward`
#
# RMSNorm drops the centring and the shift:
#
# $$y = \frac{x}{\sqrt{\frac{1}{d}\sum_i x_i^2 + \epsilon}} \odot w$$

# %% [exercise] transformer_course.layernorm:RMSNorm blank=forward difficulty=1 importance=4 minutes=10
# hint: Like your `LayerNorm` without the centring and without `b`.
# hint: Divide by the square root of (the mean of `x` squared over the last dim, plus eps), then
#   scale by `w`.

# %% [check]
check_rmsnorm(RMSNorm)

# %% [markdown]
# ## Going further
#
# - Feed `LayerNorm` a vector with a huge offset, `1e4 + torch.randn(8)`, in float32. Then
#   compute the variance the one-pass way, `x.pow(2).mean() - x.mean() ** 2`. Which one can you
#   trust, and why?
# - A `LayerNorm` followed by a linear layer: show that you can fold `w` into the linear layer's
#   weight and `b` into its bias, and check it numerically (the book page does this).
