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
#
# At the end, your `LayerNorm` goes into the chapter's experiment: the same small transformer
# trained with the norm after each residual addition (post-LN, the original transformer) and
# before each sublayer (pre-LN, GPT-2), at a learning rate where, without warmup, only one of them
# copes.

# %% tags=nbval-ignore-output
import math
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from transformer_course import validate
from transformer_course.attention import MultiHeadAttention
from transformer_course.checks.layernorm import check_layernorm, check_rmsnorm
from transformer_course.data import load_text
from transformer_course.parts import keep
from transformer_course.runtime import describe_run, seed_everything, upcast

seed_everything(0)
print(describe_run())

# %% [markdown]
# ## Exercise 4.1: `LayerNorm.forward`
#
# For each vector $x \in \mathbb{R}^{d}$ (the last dimension of the input):
#
# $$\mu = \frac{1}{d}\sum_i x_i, \qquad \sigma^2 = \frac{1}{d}\sum_i (x_i - \mu)^2, \qquad
# y = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \odot w + b$$
#
# Note the $\frac{1}{d}$ in the variance (not $\frac{1}{d-1}$) and where $\epsilon$ sits. Keep the
# two hook points: pass the standard deviation that divides, $\sqrt{\sigma^2 + \epsilon}$ (eps
# included), through `self.hook_scale` and the normalised vector (before `w` and `b`) through
# `self.hook_normalized`, and go on with what each hook returns: a hook may replace the tensor
# it is given (as in TransformerLens), and the check patches them. An input whose last dim is
# not `d_model` is refused with a `ValueError`, also one of size 1 that would broadcast against
# `w` into a wrong result: `validate.last_dim(name, x, d_model)` (given) raises it.
#
# float16 and bfloat16 inputs: compute in float32, `upcast(x)` (given), and return the result in
# the input's dtype. In float16, squaring overflows as soon as $|x| > 256$.

# %% [exercise] transformer_course.layernorm:LayerNorm blank=forward difficulty=2 importance=5 minutes=15
# hint: Every statistic is over the last dimension only, with `keepdim=True` so it broadcasts back.
# hint: The variance is the mean of squared deviations (divide by `d_model`, not `d_model - 1`) and
#   eps goes inside the square root. `hook_scale` gets the standard deviation, `hook_normalized`
#   the normalised vector before `w` and `b`.

# %% [check]
check_layernorm(LayerNorm)
keep(LayerNorm)

# %% [markdown]
# Each normalised vector has mean 0 and standard deviation 1 before the learned scale and shift,
# and the module gives the same numbers as PyTorch's `nn.LayerNorm` (whose `weight` and `bias`
# are our `w` and `b`):

# %% [check]
x = 5 + 3 * torch.randn(2, 4, 8)
ln = LayerNorm(8)
y = ln(x)
print("mean of each vector:", y.mean(-1).abs().max().item() < 1e-5)
print("std of each vector: ", ((y.var(-1, unbiased=False) - 1).abs() < 1e-3).all().item())
print("same as nn.LayerNorm:", torch.allclose(y, nn.LayerNorm(8)(x), atol=1e-5))

# %% [markdown]
# ## Exercise 4.2: `RMSNorm.forward`
#
# RMSNorm drops the centring and the shift:
#
# $$y = \frac{x}{\sqrt{\frac{1}{d}\sum_i x_i^2 + \epsilon}} \odot w$$
#
# The same conventions as `LayerNorm`: `hook_scale` gets the root mean square (eps included),
# `hook_normalized` the vector before `w`, each hook's result is used, an input of the wrong
# size is refused, and half precision is computed in float32.

# %% [exercise] transformer_course.layernorm:RMSNorm blank=forward difficulty=1 importance=4 minutes=10
# hint: Like your `LayerNorm` without the centring and without `b`.
# hint: Divide by the square root of (the mean of `x` squared over the last dim, plus eps), then
#   scale by `w`.

# %% [check]
check_rmsnorm(RMSNorm)
keep(RMSNorm)

# %% [markdown]
# ## Your LayerNorm, before or after the residual addition
#
# The experiment of the book page, with your `LayerNorm`: a small character-level language
# model on Tiny Shakespeare, four blocks of width 64, trained for 100 steps at a deliberately
# high peak learning rate, $2 \times 10^{-2}$ (Adam, cosine decay). Each block is chapter 2's
# attention and a small MLP, each wrapped in a residual connection with one of your layer
# norms, in one of two places:
#
# * post-LN, the original transformer: `x = ln1(x + attn(x))`, then `x = ln2(x + mlp(x))`;
# * pre-LN, GPT-2: `x = x + attn(ln1(x))`, then `x = x + mlp(ln2(x))`, and one more layer norm
#   before the unembedding.
#
# Each is trained with and without a linear warmup of the learning rate over the first 30
# steps; all four runs share the initial weights' seed and the batches. (Chapter 6 has you
# build the full block.)

# %%
text = load_text("tinyshakespeare")
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text])
D_MODEL, N_LAYERS, BATCH, SEQ_LEN, STEPS = 64, 4, 8, 32, 100
PEAK_LR, WARMUP = 2e-2, 30


class Block(nn.Module):
    """Causal self-attention and an MLP, each with a residual connection and your LayerNorm."""

    def __init__(self, d_model: int, norm: str) -> None:
        super().__init__()
        self.norm = norm
        self.ln1, self.ln2 = LayerNorm(d_model), LayerNorm(d_model)  # yours
        self.attn = MultiHeadAttention(d_model, n_heads=4)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.norm == "pre":
            x = x + self.attn(self.ln1(x), causal=True)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x, causal=True))
        return self.ln2(x + self.mlp(x))


class TinyLM(nn.Module):
    """Token and position embeddings, the blocks, (a final LayerNorm for pre-LN,) unembedding."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(chars), D_MODEL)
        self.pos_embed = nn.Embedding(SEQ_LEN, D_MODEL)
        self.blocks = nn.Sequential(*(Block(D_MODEL, norm) for _ in range(N_LAYERS)))
        self.ln_final = LayerNorm(D_MODEL) if norm == "pre" else nn.Identity()
        self.unembed = nn.Linear(D_MODEL, len(chars))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos_embed(torch.arange(tokens.shape[1]))
        return self.unembed(self.ln_final(self.blocks(x)))


def train(norm: str, warmup: int) -> list[float]:
    """Train one model; return its loss at every step."""
    torch.manual_seed(0)
    model = TinyLM(norm)
    optimizer = torch.optim.Adam(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.98))
    batches = torch.Generator().manual_seed(1)  # the same batches for every run
    losses = []
    for step in range(STEPS):
        starts = torch.randint(len(data) - SEQ_LEN - 1, (BATCH,), generator=batches)
        x = torch.stack([data[s : s + SEQ_LEN] for s in starts])
        y = torch.stack([data[s + 1 : s + SEQ_LEN + 1] for s in starts])
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        for group in optimizer.param_groups:
            group["lr"] = PEAK_LR * ramp * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


# %% [check] tags=nbval-ignore-output
start = time.perf_counter()
runs = {
    (norm, warmup > 0): train(norm, warmup) for norm in ("post", "pre") for warmup in (0, WARMUP)
}
print(f"4 runs of {STEPS} steps in {time.perf_counter() - start:.0f} s")
frequencies = torch.bincount(data).double() / len(data)
baseline = -(frequencies * frequencies.log()).sum().item()
final = {run: sum(losses[-10:]) / 10 for run, losses in runs.items()}
for (norm, warm), loss in final.items():
    print(f"{norm}-LN, {'with' if warm else 'no':4s} warmup: last 10 steps' mean loss {loss:.2f}")
print(f"predicting by character frequency alone:      {baseline:.2f}")
post, post_warm, pre = final[("post", False)], final[("post", True)], final[("pre", False)]
assert abs(post - baseline) < 0.25, "post-LN without warmup is stuck at the frequency baseline"
assert pre < post - 0.3, "pre-LN trains without warmup"
assert post_warm < post - 0.3, "warmup rescues post-LN"
assert abs(post_warm - pre) < 0.2, "at 100 steps, post-LN with warmup ends about level with pre-LN"

# %% [check]
for (norm, warm), losses in runs.items():
    style = "--" if warm else "-"
    color = "tab:blue" if norm == "pre" else "tab:red"
    label = f"{norm}-LN, {'with' if warm else 'no'} warmup"
    plt.plot(losses, style, color=color, label=label)
plt.axhline(baseline, color="gray", linewidth=0.8, label="character frequency alone")
plt.xlabel("step")
plt.ylabel("training loss (nats per character)")
plt.legend()
plt.show()

# %% [markdown]
# With your layer norm after the residual addition, the high learning rate breaks training from
# the first steps unless it is reached gradually; before each sublayer, the residual stream
# keeps an identity path for the gradient and the same rate is fine. The book page explains
# why (Xiong et al., 2020). After only 100 steps, post-LN with warmup and the pre-LN runs end about
# level (within 0.1 nats of each other over six seeds); the book page's longer runs separate them.

# %% [markdown]
# ## Going further
#
# - Feed `LayerNorm` a vector with a huge offset, `1e4 + torch.randn(8)`, in float32. Then
#   compute the variance the one-pass way, `x.pow(2).mean() - x.mean() ** 2`. Which one can you
#   trust, and why?
# - A `LayerNorm` followed by a linear layer: show that you can fold `w` into the linear layer's
#   weight and `b` into its bias, and check it numerically (the book page does this).
