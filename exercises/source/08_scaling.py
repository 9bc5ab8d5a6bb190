# %% [markdown]
# # Chapter 8 workbook: beyond one device
#
# Your modern decoder trains on one CPU. Real models hit two walls: attention's memory grows
# with the square of the context, and the model, its gradients and AdamW's two running means
# stop fitting on one device. You will build what gets past each wall:
#
# 1. how many parameters a model has and 2. how many FLOPs a token of training costs;
# 3. FlashAttention-2's tiled forward with the online softmax, 4. its backward, which
#    recomputes the pattern instead of keeping it, and 5. the autograd function joining them;
# 6. gradient buckets and 7. data parallelism with an all-reduce overlapped with the backward;
# 8. a sharded optimizer (ZeRO stage 1) and 9. fully sharded data parallelism (FSDP).
#
# The distributed parts run on two processes of this machine: each check forks two ranks
# joined in a `gloo` process group (PyTorch's CPU backend; on GPUs the same code runs on
# NCCL) and compares what they computed with one process training on the whole batch. At the
# end your chapter 7 modern decoder trains on two processes with your data parallelism, and
# its loss curve is the one of one process. The first cell loads your parts of chapters 1-7.

# %%
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from transformer_course.checks.scaling import (
    check_data_parallel,
    check_flash_attention_backward,
    check_flash_attention_forward,
    check_flash_attention_function,
    check_flops_per_token,
    check_fsdp,
    check_make_buckets,
    check_param_count,
    check_sharded_optimizer,
)
from transformer_course.parts import keep, load_parts, whose_parts
from transformer_course.runtime import describe_run, seed_everything

# Your chapters 1-7 (each checked again) and the course's tools, in this notebook.
load_parts(globals(), chapter=8)
seed_everything(0)
print(describe_run())

# %% [markdown]
# ## What a step costs
#
# Training in float32 with AdamW, every parameter costs 16 bytes, whatever the batch: 4 for the
# weight, 4 for its gradient and 8 for AdamW's two running means. So the first number to know
# is the parameter count. Count it from the configuration alone, for both models:
#
# - GPT-2 (`GPT2Config`, chapter 6): the token and position tables `W_E` `(d_vocab, d_model)`
#   and `W_pos` `(n_ctx, d_model)`; per block two layer norms (`w`, `b`), attention's `W_Q`,
#   `W_K`, `W_V` `(n_heads, d_model, d_head)`, `W_O` `(n_heads, d_head, d_model)` and their
#   biases, the MLP's `W_in`, `b_in`, `W_out`, `b_out`; a final layer norm; the unembedding
#   `W_U` `(d_model, d_vocab)` and `b_U`.
# - The modern decoder (`LlamaConfig`, chapter 7): `W_E`; per block two RMSNorms (`w` only),
#   `W_Q` and `W_O` with `n_heads` heads, `W_K` and `W_V` with `n_kv_heads`, SwiGLU's three
#   matrices; a final RMSNorm; `W_U`. No biases, no position table.
#
# With `cfg.tie_embeddings`, the unembedding is `W_E` itself: one tensor, counted once. Use
# `cfg.d_head` (it need not be `d_model // n_heads`) and `cfg.d_mlp`. `isinstance(cfg,
# GPT2Config)` tells the two apart.

# %% [exercise] transformer_course.step_cost:param_count difficulty=2 importance=3 minutes=15
# docstring: The number of parameters (an int) of `GPT2(cfg)` or `Llama(cfg)`, a tied
#   embedding counted once, from `cfg` alone.
# hint: Write one block's count as a sum of named pieces (attention, MLP, norms), multiply by
#   `cfg.n_layers`, then add what sits outside the blocks.
# hint: GPT-2's attention biases: `b_Q`, `b_K`, `b_V` are `(n_heads, d_head)`, `b_O` is
#   `(d_model,)`. The modern decoder's `W_K` and `W_V` hold `n_kv_heads * d_model * d_head`
#   numbers each.

# %% [check]
check_param_count(param_count)
keep(param_count)

# %% [markdown]
# A matmul costs 2 FLOPs (a multiply and an add) per weight and per token in the forward, and
# the backward does it twice: once for the gradient of the input, once for the weight's. So a
# training step costs about `6 N` FLOPs per token, where `N` counts the weights that do
# matmul work: `flop_param_count(cfg)` (given) leaves out the embedding tables, since a lookup
# costs nothing, and keeps the unembedding. Attention adds two matmuls without parameters: the
# scores `q k^T` and the weighted sum of values, each `2 H Q T` FLOPs per token and layer in
# the forward (H query heads of size Q, T positions), three times that with the backward. Per
# token, for L layers:
#
# $$\text{FLOPs} = 6N + 12\,L\,H\,Q\,T.$$
#
# This is the count of nanoGPT's `estimate_mfu` and of the course's GPT-2 benchmark. (Causal
# attention could skip half of its matmuls; the formula does not.)

# %% [exercise] transformer_course.step_cost:flops_per_token difficulty=1 importance=3 minutes=5
# docstring: Training FLOPs (an int) per token at context `seq_len`, forward and backward:
#   `6 N + 12 L H Q T`.
# hint: `H Q` is `cfg.n_heads * cfg.d_head`, and `N` is `flop_param_count(cfg)`.

# %% [check]
check_flops_per_token(flops_per_token)
keep(flops_per_token)

# %% [markdown]
# With both, the first lines of a step's bill. For GPT-2 small (tied embeddings, as OpenAI's)
# at its full context of 1,024 tokens:

# %% [check] tags=nbval-ignore-output
small = GPT2Config(tie_embeddings=True)
n = param_count(small)
print(
    f"GPT-2 small: {n:,} parameters, {16 * n / 2**30:.2f} GiB of weights, gradients and "
    f"AdamW state; {flops_per_token(small, 1024) / 1e9:.2f} GFLOPs per token"
)
no_bias = 124_439_808  # Hugging Face's GPT2LMHeadModel: the same, without b_U
assert n == no_bias + small.d_vocab, "Hugging Face's count, plus the unembedding's bias b_U"

# %% [markdown]
# What the backward needs from the forward, the *activations*, costs bytes per token instead,
# and attention's share grows with the context: it keeps each head's `T x T` pattern. The book
# page counts it and plots it. The way out is not to keep the pattern at all.
#
# ## FlashAttention-2
#
# Attention computes `S = q k^T / sqrt(d)`, `P = softmax(S)` and `O = P v` for every query and
# key at once. FlashAttention (Dao et al., 2022; FlashAttention-2, Dao, 2023) walks over tiles
# instead: `q_tile` queries meet the keys and values `k_tile` at a time, and the softmax is
# computed *online*. For each query row keep the largest score so far `m`, the sum so far of
# `exp(s - m)`, `l`, and the unnormalised output `acc`. When a tile of scores `S_j` arrives:
#
# $$m' = \max(m, \text{rowmax}(S_j)), \quad
# l \leftarrow e^{m - m'} l + \text{rowsum}(e^{S_j - m'}), \quad
# acc \leftarrow e^{m - m'} acc + e^{S_j - m'} V_j, \quad m \leftarrow m'.$$
#
# The factor `exp(m - m')` corrects the sums taken against the old, smaller maximum. After the
# last tile, `out = acc / l`, and the row's log-sum-exp is `L = m + log(l)`: the one number per
# query the backward needs.
#
# Write `flash_attention_forward(q, k, v, causal=False, *, q_tile, k_tile)`: q `(..., n_queries,
# d)`, k and v `(..., n_keys, d)`; return `(out, L)` with `L` of shape `(..., n_queries)`.
# With `causal=True` the queries are the *last* `n_queries` positions of the keys (the
# alignment of your `causal_mask`: query `i` sees keys `j <= i + n_keys - n_queries`); you may
# skip the tiles that lie wholly above the diagonal. Compute in float32 for half-precision
# inputs (`upcast`, given) and return `out` in the input's dtype, `L` in float32 (or float64
# for float64 inputs). Never build a tensor of the whole `n_queries x n_keys` pattern: the
# check watches every tensor your code makes.

# %% [exercise] transformer_course.flash_attention:flash_attention_forward difficulty=4 importance=5 minutes=40
# docstring: The tiled forward with the online softmax: `(out, L)`, the output
#   `(..., n_queries, d)` and the log-sum-exp of each query's scores `(..., n_queries)`.
# hint: Two loops: over query tiles `i0 = 0, q_tile, ...`, and inside over key tiles. Each
#   query tile starts with `m = -inf`, `l = 0`, `acc = 0`, and writes its rows of `out` and `L`
#   when its key loop ends.
# hint: In a causal tile, fill the scores a query may not see with `-inf` before the max: the
#   tile's mask is `keys <= queries + n_keys - n_queries`, from two `arange`s.
# hint: Every query sees key 0, which lies in the first key tile, so `m` is finite from the
#   first tile on and `exp(m - m')` never meets `-inf - (-inf)`.

# %% [check]
check_flash_attention_forward(flash_attention_forward)
keep(flash_attention_forward)

# %% [markdown]
# ### The backward, from one number per query
#
# Plain attention keeps `P` for the backward. FlashAttention keeps only `L` and rebuilds each
# tile of `P` when it needs it: `P = exp(S - L)`, exact, since `L` is the log of the row's
# softmax denominator. With `dO` the gradient of the output, and `D = rowsum(dO * O)` (one
# number per query, equal to `rowsum(P * dP)`: the softmax's correction term), each tile of
# queries `i` and keys `j` contributes
#
# $$dV_j \mathrel{+}= P^\top dO_i, \quad dP = dO_i V_j^\top, \quad dS = P \odot (dP - D_i),
# \quad dQ_i \mathrel{+}= dS\, K_j / \sqrt{d}, \quad dK_j \mathrel{+}= dS^\top Q_i / \sqrt{d}.$$
#
# Write `flash_attention_backward(q, k, v, out, L, grad_out, causal=False, *, q_tile, k_tile)`
# returning `(dq, dk, dv)`, each in its input's dtype (accumulate in float32 for half
# precision). FlashAttention-2 puts the key tiles in the outer loop, so each tile's `dK` and
# `dV` are finished before the next; `dQ` accumulates across them. In a causal tile, `P` is 0
# where a query may not see a key.

# %% [exercise] transformer_course.flash_attention:flash_attention_backward difficulty=4 importance=4 minutes=40
# docstring: The gradients `(dq, dk, dv)` of attention from the saved output `out` and
#   log-sum-exp `lse`, recomputing each tile's pattern `P = exp(S - lse)`.
# hint: Start with `D = (grad_out * out).sum(-1)` and three zero tensors for the gradients;
#   then the loops, key tiles outside, query tiles inside.
# hint: Recompute `S` exactly as the forward did (scaled), then `P = exp(S - L[..., None])`;
#   the causal mask now zeroes `P` (`masked_fill(~visible, 0.0)`).

# %% [check]
check_flash_attention_backward(flash_attention_backward)
keep(flash_attention_backward)

# %% [markdown]
# Autograd calls a `torch.autograd.Function`'s `forward` and, in the backward pass, its
# `backward` with the gradient of the output. Join your two functions: `forward(ctx, q, k, v,
# causal, q_tile, k_tile)` saves what the backward needs with `ctx.save_for_backward(...)`:
# q, k, v, the output and `L`, nothing of the pattern's size. Non-tensor settings go on `ctx`
# as attributes. `backward(ctx, grad_out)` returns one gradient per input of `forward`: `dq,
# dk, dv`, then `None` for each of the other three.

# %% [exercise] transformer_course.flash_attention:FlashAttention blank=forward,backward difficulty=2 importance=4 minutes=10
# docstring forward: The attention output; saves q, k, v, the output and its log-sum-exp.
# docstring backward: `(dq, dk, dv, None, None, None)` from what `forward` saved.
# hint: `ctx.saved_tensors` gives back what `save_for_backward` got, in the same order.

# %% [check]
check_flash_attention_function(FlashAttention)
keep(FlashAttention)

# %% [markdown]
# Now measure what the backward keeps. `SavedTensorBytes` (given) counts the bytes autograd
# saves between the forward and the backward: your function keeps q, k, v, the output and L,
# growing with the context; plain attention also keeps each head's pattern, growing with its
# square.

# %% [check] tags=nbval-ignore-output
for n_ctx in (256, 1024):
    q, k, v = (torch.randn(1, 4, n_ctx, 32, requires_grad=True) for _ in range(3))
    kept = {}
    for name in ("plain", "flash"):
        with SavedTensorBytes(exclude=(q, k, v)) as saved:
            if name == "plain":
                scaled_dot_product_attention(q, k, v, causal_mask(n_ctx))
            else:
                FlashAttention.apply(q, k, v, True)
        kept[name] = saved.bytes
    print(
        f"context {n_ctx:>5}: plain keeps {kept['plain'] / 2**20:6.2f} MiB, "
        f"flash {kept['flash'] / 2**20:5.2f} MiB"
    )
assert kept["plain"] > 10 * kept["flash"], "at 1,024 tokens plain attention keeps 10x more"

# %% [markdown]
# Your Python loop is slower than plain attention's one matmul: the speed comes when each tile
# lives in a GPU's on-chip memory, which is what a Triton kernel does (the book page).
#
# ## Data parallelism
#
# Every rank holds the whole model, takes its own slice of the batch, and before each
# optimizer step the ranks *average their gradients* with an all-reduce: then every rank takes
# the step one process would take on the whole batch. Sending each gradient alone wastes time
# (each collective has a fixed latency), so gradients travel in *buckets* of about
# `bucket_size_mb` MiB, and a bucket leaves as soon as all its gradients exist, while the
# backward goes on computing the rest.
#
# First the buckets. `params` come in the order the backward produces their gradients (the
# reverse of the model's). Cut them into consecutive buckets: add each parameter to the last
# bucket while the bucket's gradients stay within `bucket_size_mb` MiB (`2**20` bytes; a
# parameter takes `numel() * element_size()` bytes), else start a new bucket (a parameter
# larger than a bucket goes alone). One bucket becomes one flat tensor, so a change of dtype
# also starts a new bucket. With `bucket_size_mb=None`, one bucket per parameter.

# %% [exercise] transformer_course.data_parallel:make_buckets difficulty=2 importance=3 minutes=10
# hint: Keep the bytes used by the last bucket; start a new bucket when the next parameter
#   would make it pass the limit, or when its dtype differs from the bucket's first.

# %% [check]
check_make_buckets(make_buckets)
keep(make_buckets)

# %% [markdown]
# Now `DataParallel(module, bucket_size_mb=None)`. Its `__init__` (given) broadcasts rank 0's
# weights, makes the buckets with your `make_buckets`, and registers on every parameter a
# hook that runs when its gradient is complete: `_grad_ready` (given) counts the gradients of
# each bucket and calls `self._start(bucket)` for each full bucket, strictly in order (every
# rank must start the same collectives in the same order, or they pair up wrongly and hang).
# Write the two methods that move the numbers:
#
# - `_start(bucket)`: put the bucket's gradients in one flat tensor, divided by the world size
#   (gloo has no averaging all-reduce), and start `dist.all_reduce(flat, async_op=True)`; keep
#   the tensor in `bucket.flat` and the returned work in `bucket.work`. A parameter may have no
#   gradient on this rank (unused in this forward): send zeros for it, and append to the flat
#   tensor one flag per parameter, 1 if this rank had its gradient, so that after the sum the
#   flag counts the ranks that had one.
# - `finish_gradient_synchronization()`: called after `backward()`, before `step()`. Start the
#   buckets still waiting (from `self._next` on: a gradient that never came), wait for every
#   bucket's work, and write each averaged gradient back into `p.grad`. A parameter no rank used
#   keeps `grad = None`; one that only some ranks used gets its averaged gradient as a new
#   `.grad`. Then reset the step's state: each bucket's `ready`, `flat` and `work`,
#   `self._has_grad` and `self._next`.

# %% [exercise] transformer_course.data_parallel:DataParallel blank=_start,finish_gradient_synchronization difficulty=3 importance=5 minutes=30
# docstring _start: Start the asynchronous all-reduce of the bucket's gradients (each divided by
#   the world size, zeros where missing) and of one flag per parameter.
# docstring finish_gradient_synchronization: Start the buckets still waiting, wait for every
#   all-reduce, and set each parameter's gradient to the average over ranks.
# hint: `torch.cat([*(g.flatten() for g in grads), flags])`, with `flags` a tensor of 0s and 1s
#   in the gradients' dtype; `bucket.flat[-n:]` are the flags after the sum.
# hint: Split the summed gradients back with `bucket.flat[:-n].split([p.numel() for p in
#   bucket.params])` and `.view_as(p)` each piece.

# %% [check]
check_data_parallel(DataParallel)
keep(DataParallel)

# %% [markdown]
# ## Sharding the optimizer (ZeRO stage 1)
#
# Data parallelism keeps on every rank the whole of AdamW's state: 8 of the 16 bytes per
# parameter. ZeRO (Rajbhandari et al., 2020) shards it: each parameter is *owned* by one rank,
# which alone keeps its optimizer state and updates it; then every rank broadcasts the
# parameters it owns, so all ranks again hold the same model. `ShardedOptimizer(params,
# optimizer_cls, **kwargs)` wraps any optimizer class. Its `add_param_group` (given) assigns
# the owners (`self.owner[p]`, largest parameters first, to the rank that owns the fewest
# elements so far) and builds `self.optimizer`, this rank's own `optimizer_cls` over the
# parameters it owns (None if it owns none), with `self._local_group[i]` the index in
# `self.optimizer.param_groups` of this rank's part of group `i` (None if it owns none of it).
#
# Write `step()`: a learning-rate schedule changes `group["lr"]` in `self.param_groups`, so
# first copy each group's settings (everything but `"params"`) into this rank's part of it;
# step `self.optimizer`; then broadcast every parameter from its owner.

# %% [exercise] transformer_course.sharded:ShardedOptimizer blank=step difficulty=3 importance=4 minutes=20
# docstring step: Update this rank's parameters, then broadcast every parameter from its owner.
# hint: `dist.broadcast(p, src=self.owner[p])` on every rank, for every parameter, in the same
#   order everywhere: the owner sends, the others receive into `p`.
# hint: Start the broadcasts with `async_op=True` and wait for them all at the end: they then
#   overlap with one another.

# %% [check]
check_sharded_optimizer(ShardedOptimizer)
keep(ShardedOptimizer)

# %% [markdown]
# ## Fully sharded data parallelism
#
# FSDP (ZeRO stage 3) shards everything: each rank keeps `1/world_size` of every parameter, of
# its gradient and, with an optimizer over those slices, of its optimizer state. A layer's
# whole parameters exist only while it computes: all-gathered just before its forward, freed
# just after, gathered again in the backward; their gradients are summed and cut across the
# ranks by a *reduce-scatter*. `FullyShardedDataParallel(module, compute_dtype=None,
# replicate_below=0)` is given except the three methods that define the slices (the parameters
# with fewer than `replicate_below` elements are not sliced: the given `_make_replica`, `_whole`
# and `_send_gradient` keep those whole on every rank and all-reduce their gradients):
#
# - `_make_shard(p)`: flatten `p`, pad it with zeros to `world_size * shard_numel` elements,
#   `shard_numel = ceil(numel / world_size)`, and return this rank's slice `self.rank *
#   shard_numel ...` as a new float32 `nn.Parameter` (same `requires_grad`), and record how
#   it was cut: `self._shards` maps the new parameter to a `_Shard` of the whole's shape, its
#   number of elements and `shard_numel`.
# - `_all_gather(shard, dtype=None)`: the whole parameter back, in `dtype` (default
#   `self.compute_dtype`): every rank's slice gathered into one flat tensor with
#   `all_gather_single(flat, mine)`, the padding cut off, and the original shape.
# - `_reduce_scatter(shard, grad_full)`: the whole gradient, in float32, padded like the
#   parameter and divided by the world size; start `reduce_scatter_single(out, flat,
#   async_op=True)`, which sums the ranks' `flat` and gives each rank its slice in `out`, and
#   append `(shard, out, work)` to `self._pending` (`finish_gradient_synchronization` waits).
#
# `all_gather_single` and `reduce_scatter_single` are PyTorch's collectives on one flat
# tensor (`dist.all_gather_into_tensor` and `dist.reduce_scatter_tensor`).

# %% [exercise] transformer_course.sharded:FullyShardedDataParallel blank=_make_shard,_all_gather,_reduce_scatter difficulty=3 importance=5 minutes=30
# docstring _make_shard: This rank's float32 slice of `p`, flattened and zero-padded to a
#   multiple of the world size, as a new parameter.
# docstring _all_gather: The whole parameter of `shard`, in `dtype` (default the compute dtype).
# docstring _reduce_scatter: Start summing `grad_full / world_size` over ranks into this rank's
#   slice.
# hint: The same padding everywhere: a flat tensor of `shard_numel * world_size` elements,
#   zeros, with the parameter (or gradient) written into its first `numel`.
# hint: Gather in the compute dtype: cast your slice before `all_gather_single`, so a bfloat16
#   step moves half the bytes.

# %% [check]
check_fsdp(FullyShardedDataParallel)
keep(FullyShardedDataParallel)

# %% [markdown]
# ## Your modern decoder on two processes
#
# Everything below is yours: your chapter 7 `Llama` with your `AdamW` trains on Tiny
# Shakespeare, once in this process on batches of 16 sequences, and once on two processes
# with your `DataParallel`, each rank on its own 8 of the same 16. Rank 1 starts from other
# weights (its own seed): your broadcast replaces them with rank 0's. The loss of the two
# processes together is the mean of the ranks' losses. If your gradients are averaged right,
# the two runs take the same steps, and the curves agree to float32 rounding (the ranks sum
# the batch in a different order): the cell asserts a gap below 1e-3 at every step.

# %% [check] tags=nbval-ignore-output
import matplotlib.pyplot as plt

from transformer_course.data import load_text
from transformer_course.ranks import on_ranks
from transformer_course.runtime import by_profile

text = load_text("tinyshakespeare")
chars = CharTokenizer(text)
data = torch.tensor(chars.encode(text))
steps, batch_size = by_profile(quick=60, full=300), 16
cfg = LlamaConfig(
    d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_vocab=chars.vocab_size, n_ctx=64
)


def train(rank=None, world_size=2):
    """Losses of `steps` AdamW steps, on one process (rank None) or as rank `rank`."""
    seed_everything(rank or 0)
    model = Llama(cfg)
    if rank is not None:
        model = DataParallel(model, bucket_size_mb=0.25)
    optimizer = AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    batches, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        tokens, targets = sample_batch(data, batch_size, cfg.n_ctx, generator=batches)
        if rank is not None:
            mine = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
            tokens, targets = tokens[mine], targets[mine]
        loss = lm_loss(model(tokens), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if rank is not None:
            model.finish_gradient_synchronization()
            loss = loss.detach() / world_size
            dist.all_reduce(loss)  # the mean of the ranks' losses
        optimizer.step()
        losses.append(loss.item())
    return losses


one_process = train()
two_processes = on_ranks(train)[0]
gap = max(abs(a - b) for a, b in zip(one_process, two_processes))
print(
    f"loss after {steps} steps: one process {one_process[-1]:.4f}, "
    f"two processes {two_processes[-1]:.4f}; largest gap {gap:.1e}"
)
assert one_process[-1] < one_process[0] - 0.5, "the model learns"
assert gap < 1e-3, "two processes with your DataParallel take one process's steps"
plt.plot(one_process, label="one process, 16 sequences")
plt.plot(two_processes, "--", label="two processes, 8 each (your DataParallel)")
plt.xlabel("step")
plt.ylabel("training loss (nats per character)")
plt.legend()
plt.show()

# %% [markdown]
# The table of your parts, chapters 1 to 8:

# %% tags=nbval-ignore-output
whose = whose_parts(globals(), chapter=8)

# %% [markdown]
# ## More to try
#
# - Time your `DataParallel` with `bucket_size_mb=None` and with `bucket_size_mb=25` on a
#   larger model: how many all-reduces does each step start?
# - Wrap the model in your `FullyShardedDataParallel` with `compute_dtype=torch.bfloat16` and
#   train it with a `ShardedOptimizer`: what does each rank keep, in bytes per parameter?
# - `scripts/train_gpt2.py --parallel fsdp` under `torchrun --nproc_per_node 2` trains GPT-2
#   with the course's parts and prints the bytes each rank sent per step.
