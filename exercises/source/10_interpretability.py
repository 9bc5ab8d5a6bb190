# %% [markdown]
# # Chapter 10 workbook: what your model learned
#
# For nine chapters you built models and checked what they output. Now you look inside one.
# Every activation of the course's models passes a *hook point* named as TransformerLens
# names it, and with a few tools you will find a mechanism in a model you train yourself:
#
# 1. running a model with hooks that edit its activations;
# 2. previous-token, 3. first-token and 4. induction scores of every head, read from its
#    attention pattern, and 5. the loss on each repeat of a repeated random sequence;
# 6. direct logit attribution: the logit of the right token split into what each head wrote;
# 7. ablation: a hook that removes a head;
# 8. activation patching of the residual stream and 9. of each head, from a clean run into a
#    corrupted one;
# 10. K-composition: how a head's keys read what an earlier head wrote, from the weights alone.
#
# At the end you train a two-layer attention-only transformer on text where copying pays,
# and your own tools find its induction heads (Olsson et al., 2022) and the previous-token
# head they rely on: ablation, attribution and patching show what each does, and the weights
# show how they compose. Last, your detectors look inside the GPT-2 you trained on Tiny
# Shakespeare in chapter 6. The first cell loads your parts of chapters 1-9.

# %%
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import head_detectors
from transformer_course.checks.interpretability import (
    check_ablation_hook,
    check_first_token_scores,
    check_induction_scores,
    check_k_composition_scores,
    check_logit_attribution,
    check_patch_head_all_pos,
    check_patch_residual,
    check_prev_token_scores,
    check_repeat_losses,
    check_run_with_hooks,
)
from transformer_course.parts import keep, load_model, load_parts, whose_parts
from transformer_course.runtime import describe_run, seed_everything

# Your chapters 1-9 (each checked again) and the course's tools, in this notebook.
load_parts(globals(), chapter=10)
seed_everything(0)
print(describe_run())

# %% [markdown]
# ## Caches and hooks
#
# Your chapter 6 GPT-2 is a TransformerLens `HookedRootModule`: each intermediate tensor
# passes through a `HookPoint`, an identity module with a name. `hook_names(model)` lists
# them in the order the forward pass reaches them: `hook_embed`, `blocks.0.attn.hook_q`,
# `blocks.0.attn.hook_pattern` `(batch, head, q_pos, k_pos)`, `blocks.0.attn.hook_z`
# `(batch, pos, head, d_head)` (each head's attention-weighted values, before `W_O`),
# `blocks.0.hook_resid_pre` `(batch, pos, d_model)` ... `run_with_cache(model, tokens, names)`
# (given) returns the logits and a dictionary of the activations asked for. The cell
# recomputes layer 0's pattern from the cached queries and keys.

# %%
seed_everything(0)
gpt2 = GPT2(GPT2Config(d_model=32, n_layers=2, n_heads=4, d_vocab=50, n_ctx=16))
tokens = torch.randint(0, 50, (2, 10))
logits, cache = run_with_cache(gpt2, tokens, ["blocks.0.attn.hook_q", "blocks.0.attn.hook_k",
                                              "blocks.0.attn.hook_pattern"])
print(f"{len(hook_names(gpt2))} hook points; cached:",
      {name: tuple(act.shape) for name, act in cache.items()})
q, k = cache["blocks.0.attn.hook_q"], cache["blocks.0.attn.hook_k"]
scores = einops.einsum(q, k, "batch q_pos head d, batch k_pos head d -> batch head q_pos k_pos")
scores = scores / q.shape[-1] ** 0.5
pattern = scores.masked_fill(~causal_mask(10), float("-inf")).softmax(-1)
assert torch.allclose(pattern, cache["blocks.0.attn.hook_pattern"], atol=1e-6)

# %% [markdown]
# A hook can also *replace* an activation: TransformerLens calls it with the activation and
# the hook point, `fn(activation, hook)`, and the model goes on with what it returns.
# `model.run_with_hooks(tokens, fwd_hooks=[(name, fn), ...])` runs the model once with those
# hooks and removes them after. Write `run_with_hooks(model, tokens, hooks)`, with `hooks` a
# dictionary `{name: fn}`, safer than the raw call in two ways:
#
# - a name that is not a hook point of the model is a `KeyError` (`check_hook_names`, given,
#   raises one that lists the nearest names), never a run that quietly edits nothing;
# - a hook must return the activation to use, of the activation's shape: one that returns
#   None (it edited a copy and forgot to return it; TransformerLens would keep the original
#   and say nothing) is a `ValueError` that names the hook point.
#
# Run in eval mode without gradients, the model's mode restored after: the context manager
# `evaluating` (given) does all three.

# %% [exercise] transformer_course.hooks:run_with_hooks difficulty=2 importance=4 minutes=15
# docstring: The logits of `tokens` with each hook point named in `hooks` replaced by what its
#   function returns; a misspelt name and a hook that returns no tensor of the activation's
#   shape are errors.
# hint: Wrap each function in one of your own that calls it and checks the result before
#   returning it; hand the wrapped ones to TransformerLens.
# hint: A closure in a loop sees the loop variable's last value: build each wrapper in a
#   helper function `returning(name, fn)` that returns it.

# %% [check]
check_run_with_hooks(run_with_hooks)
keep(run_with_hooks)

# %% [markdown]
# ## What kind of head is it?
#
# A head's pattern says where each query looks. Three kinds are easy to spot on any input:
#
# - a *previous-token head* attends from each position to the one just before it: the
#   diagonal one below the main diagonal of its pattern;
# - a *first-token head* attends to position 0, a resting place when it has nothing to do;
# - an *induction head* (Olsson et al., 2022) completes patterns: at a token seen before, it
#   attends to the token that *followed* the earlier occurrence, and copies it.
#
# Each detector takes one layer's pattern `(batch, head, q_pos, k_pos)` and returns one score
# per head `(head,)`: the mean attention weight, over the batch and the queries, on the key
# that kind of head looks at. Query 0 has no choice (it can only see itself): leave it out of
# the previous-token and first-token scores. `einops.reduce(x, "batch head q -> head",
# "mean")` averages; `Tensor.diagonal(offset, dim1, dim2)` reads a diagonal of the last two
# dims.

# %% [exercise] transformer_course.head_detectors:prev_token_scores difficulty=1 importance=4 minutes=5
# docstring: Mean attention from each query (1 ..) to the position just before it: `(head,)`.
# hint: The previous-token entries `pattern[b, h, q, q - 1]` lie on one diagonal, below the
#   main one: negative offsets go down.

# %% [check]
check_prev_token_scores(prev_token_scores)
keep(prev_token_scores)

# %% [exercise] transformer_course.head_detectors:first_token_scores difficulty=1 importance=3 minutes=5
# docstring: Mean attention from each query (1 ..) to position 0: `(head,)`.
# hint: Key 0 is the last dim's first entry; the queries from 1 on are the third dim from 1.

# %% [check]
check_first_token_scores(first_token_scores)
keep(first_token_scores)

# %% [markdown]
# The induction score is read on a random segment written twice (after an optional BOS
# token): `[BOS, x, x]` or `[x, x]`, `seg_len` tokens each. A query of the second repeat at
# position `q` holds the token first seen at `q - seg_len`; the token that followed it sits at
# `q - seg_len + 1`. So the induction head's weight lies on one diagonal of the pattern;
# average it over the *second repeat's queries* (the last `seg_len` positions) and the batch.
# Get the offset right: one more back is the earlier occurrence itself (what a
# *duplicate-token* head looks at), not what came after it.

# %% [exercise] transformer_course.head_detectors:induction_scores difficulty=2 importance=5 minutes=10
# docstring: Mean attention from each query of the second repeat (the last `seg_len`
#   positions) to the token after the same token's earlier occurrence: `(head,)`.
# hint: Write the offset for one query first: from `q` to `q - seg_len + 1`.
# hint: `pattern.diagonal(offset=-(seg_len - 1), dim1=-2, dim2=-1)` holds those weights, and
#   its last `seg_len` entries belong to the second repeat's queries.

# %% [check]
check_induction_scores(induction_scores)
keep(induction_scores)

# %% [markdown]
# An induction head shows in the loss too. `per_token_loss(logits, tokens)` (given) is the
# cross-entropy of each next token, `(batch, pos - 1)`: entry `i` is the loss of predicting
# `tokens[:, i + 1]` from position `i`. Write `repeat_losses(loss, seg_len)`, returning the
# losses `(first, second)`, each `(batch, seg_len - 1)`: of predicting each token of the first
# repeat, and of the second, *but the repeat's first token* (a random segment: nothing
# predicts its first token, and nothing says where the second repeat starts). The sequences
# end with the second repeat and may start with a BOS token or not: count from the end.

# %% [exercise] transformer_course.head_detectors:repeat_losses difficulty=2 importance=3 minutes=10
# docstring: The per-token losses `(first, second)`, each `(batch, seg_len - 1)`, of the two
#   repeats' tokens but each repeat's first.
# hint: The last token of the sequence is the second repeat's last; its loss is the last
#   entry of `loss`. Count back from there.
# hint: The second repeat's tokens but its first are the last `seg_len - 1` entries,
#   `loss[:, -(seg_len - 1):]`; the first repeat's end `seg_len` entries before those.

# %% [check]
check_repeat_losses(repeat_losses)
keep(repeat_losses)

# %% [markdown]
# ## Direct logit attribution
#
# The residual stream at the end is a sum of what each part wrote: the token and position
# embeddings, each head's `z[head] @ W_O[head]`, each layer's `b_O` and each MLP's output.
# The logit of token `t` is `LN(resid) @ W_U[:, t] + b_U[t]`, and the final layer norm is
# linear once its *scale* (each vector's standard deviation) is frozen at the value the run
# had: `LN(resid) = sum over parts of (part - mean(part)) / scale * w + b`. So the logit is a
# sum of one number per part, plus a constant.
#
# Write `logit_attribution(model, cache, tokens)`: each part's share of the logit of the next
# token at every position but the last, `(part, batch, pos - 1)`, and the parts' names, in
# this order: "embed", "pos_embed", then per layer "L{l}H{h}" for each head, "L{l} b_O" and
# "L{l} MLP" (those the model has), and last "bias": `b @ W_U[:, t] + b_U[t]`.
# `attribution_names(model)` (given) lists the activations to read, in that order, ending
# with `ln_final.hook_scale`, the frozen scale `(batch, pos, 1)`; `activation(cache, name)`
# reads one with a clear error; `unembedding(model)` is `W_U`. The attention-only model has
# no norms (`model.ln_final` is `nn.Identity`, with no `w`) and no MLPs. Compute in float64
# and return the input's dtype. The shares summed over parts give the logits.

# %% [exercise] transformer_course.attribution:logit_attribution difficulty=4 importance=5 minutes=40
# docstring: Each part's share `(part, batch, pos - 1)` of the logit of the next token, and the
#   parts' names; the final norm's scale frozen at the cached value.
# hint: A head's part is `einsum(z, W_O, "batch pos head d_head, head d_head d_model -> head
#   batch pos d_model")`: one residual-stream vector per head.
# hint: With all the parts stacked `(part, batch, pos, d_model)`: centre each (a LayerNorm
#   subtracts the mean over d_model), divide by the cached scale, times `ln_final.w`, then
#   take the dot product with the next token's column `W_U[:, tokens[:, 1:]]`.
# hint: The bias part is `ln_final.b @ W_U[:, t] + b_U[t]` for a LayerNorm, `b_U[t]` alone
#   without a norm.

# %% [check]
check_logit_attribution(logit_attribution)
keep(logit_attribution)

# %% [markdown]
# ## Ablation
#
# A head's whole effect on the rest of the model goes through its `z`
# (`blocks.{l}.attn.hook_z`, `(batch, pos, head, d_head)`). A hook that replaces a head's `z`
# removes the head: *zero-ablation* puts zeros there; *mean-ablation* puts the head's mean `z`
# at each position over a batch, `mean` `(pos, head, d_head)` (the gentler test: only the
# head's dependence on this input is removed).
#
# Write `ablation_hook(heads, kind="zero", mean=None)`: it returns a hook `hook(z, hook=None)`
# that returns `z` with the heads in `heads` replaced, the other heads' `z` and the tensor it
# was given left as they were (an in-place edit would also change a cached copy). A hook that
# edits and forgets to return changes nothing: TransformerLens goes on with what the hook
# returns. Refuse a `kind` other than "zero" and "mean", and `mean` given with "zero" or
# missing with "mean".

# %% [exercise] transformer_course.ablation:ablation_hook difficulty=2 importance=4 minutes=10
# docstring: A `hook_z` hook that returns `z` with `heads` zeroed (`kind="zero"`) or set to
#   `mean` at each position (`kind="mean"`).
# hint: `z.clone()` first; then index the head dim, the third: `z[:, :, heads]`.
# hint: `mean[: z.shape[1], heads]` is the mean at the run's positions, for those heads.

# %% [check]
check_ablation_hook(ablation_hook)
keep(ablation_hook)

# %% [markdown]
# ## Activation patching
#
# Ablation says what a head matters for; *patching* says where the information that decides
# the answer travels. Run the model on a *clean* input and on a *corrupted* one that differs
# in one place (with as many tokens, so positions line up), and measure the output with a
# metric such as the logit difference between the clean answer and the corrupted one
# (`logit_difference(logits, correct, wrong)`, given). Then run the corrupted input again,
# each time with one activation taken from the clean run. Where that brings back the clean
# metric, that activation carries what the corruption changed.
#
# Write `patch_residual(model, clean_tokens, corrupted_tokens, metric)`: entry `[l, p]` of the
# result `(layer, pos)` is the metric of the corrupted run with the residual stream entering
# layer `l` (`blocks.{l}.hook_resid_pre`) *at position `p` only* taken from the clean run.
# `_clean_cache(model, clean_tokens, corrupted_tokens, names)` (given) checks that the two
# inputs have the same shape and returns the clean run's activations `names`;
# `run_with_hooks` is yours.

# %% [exercise] transformer_course.patching:patch_residual difficulty=3 importance=5 minutes=20
# docstring: `[l, p]`: the metric of the corrupted run with `blocks.{l}.hook_resid_pre` at
#   position `p` taken from the clean run.
# hint: For each layer and position, a hook that clones the corrupted activation, copies the
#   clean one into `[:, p]` and returns it; then `float(metric(...))` of the hooked run.
# hint: `_patched(model, tokens, name, clean, where, metric)` (given) does one such run with
#   `where = (slice(None), p)`.

# %% [check]
check_patch_residual(patch_residual)
keep(patch_residual)

# %% [markdown]
# The same for each head: `patch_head_all_pos(model, clean_tokens, corrupted_tokens, metric)`
# `(layer, head)`, entry `[l, h]` the metric with head `h`'s `z` of layer `l`
# (`blocks.{l}.attn.hook_z`, at every position) taken from the clean run, the other heads left
# corrupted. These equal `transformer_lens.patching`'s `get_act_patch_resid_pre` and
# `get_act_patch_attn_head_out_all_pos` on the same model and inputs.

# %% [exercise] transformer_course.patching:patch_head_all_pos difficulty=2 importance=4 minutes=10
# docstring: `[l, h]`: the metric of the corrupted run with head `h`'s `z` of layer `l`, at
#   every position, taken from the clean run.
# hint: As `patch_residual`, with `hook_z` and the slice of one head: `z` is `(batch, pos,
#   head, d_head)`.

# %% [check]
check_patch_head_all_pos(patch_head_all_pos)
keep(patch_head_all_pos)

# %% [markdown]
# ## Composition, from the weights
#
# In TransformerLens's row-vector convention a head reads `x @ W_V[h]` at each key and writes
# `... @ W_O[h]`: its *OV circuit* `W_OV = W_V[h] @ W_O[h]` `(d_model, d_model)` is what it
# adds to the stream for each vector it attends to. Its score between a query vector `x_q`
# and a key vector `x_k` is `x_q @ W_QK @ x_k.T` with the *QK circuit* `W_QK = W_Q[h] @
# W_K[h].T` (`ov_circuit` and `qk_circuit`, given). Heads compose (Elhage et al., 2021): an
# induction head's keys read what a previous-token head wrote. If head A of an earlier layer
# writes `y @ W_OV_A` at a key, head B scores it `x_q @ W_QK_B @ W_OV_A.T @ y.T`: the
# composed matrix is `W_QK_B @ W_OV_A.T`. The *K-composition score* is its Frobenius norm
# over the product of the two matrices' norms: near 1 when B's keys read all of what A
# writes, about `1 / sqrt(d_model)` for unrelated random matrices.
#
# Write `k_composition_scores(model, layer_a=0, layer_b=1)` `(head_a, head_b)`: the score of
# every head of `layer_a` with every head of the later `layer_b`. `composition_score(W_A, W_B)`
# (given) is `||W_A @ W_B||_F / (||W_A||_F ||W_B||_F)` over the last two dims, broadcasting
# the others. The scores equal TransformerLens's `all_composition_scores("K")`.

# %% [exercise] transformer_course.circuits:k_composition_scores difficulty=3 importance=4 minutes=20
# docstring: `[a, b]`: the K-composition score of head `a` of `layer_a` with head `b` of
#   `layer_b`.
# hint: Stack every head's OV circuit of `layer_a` `(head_a, d, d)` and QK circuit of `layer_b`
#   `(head_b, d, d)`; give them singleton dims so they broadcast to `(head_a, head_b, d, d)`.
# hint: Which product: the keys read A's output, so it is `W_QK_B @ W_OV_A.T`: the transposed
#   OV circuits on the right, the QK circuits on the left.

# %% [check]
check_k_composition_scores(k_composition_scores)
keep(k_composition_scores)

# %% [markdown]
# ## Capstone: find the induction head in a model you train
#
# A two-layer attention-only transformer (no MLPs, no norms: every path from a token to a
# logit goes through heads) trains on text where copying pays: `copying_batch` rows, each a
# random segment repeated with a period that differs from row to row. The first period is
# random, so it costs at least `ln d_vocab` nats per token whatever the model does; every
# later token is predictable by a model that finds the previous occurrence of the current
# token and copies what followed it. That takes two heads that compose: a previous-token head in layer 0 writes
# "my previous token was x" into each position, and an induction head in layer 1 finds, with
# its keys, the position whose previous token is the current one. The model starts with
# larger weights than GPT-2's (`init_range=0.2`), which brings the phase change forward.
#
# First the untrained model on repeated random segments, measured with your `repeat_losses`:
# both repeats cost about `ln d_vocab`. Then 600 AdamW steps, about 10 seconds.

# %% [check] tags=nbval-ignore-output
import math

import matplotlib.pyplot as plt

cfg = AttentionOnlyConfig(d_model=32, n_heads=2, d_vocab=64, n_ctx=32, init_range=0.2)
seg_len, layers = cfg.n_ctx // 2, range(cfg.n_layers)
repeated = repeated_tokens(32, seg_len, cfg.d_vocab, seed=1)


def losses_on_repeats(model):
    """The mean loss on the first and on the second repeat, with your `repeat_losses`."""
    with evaluating(model):
        first, second = repeat_losses(per_token_loss(model(repeated), repeated), seg_len)
    return first.mean().item(), second.mean().item()


seed_everything(0)
model = AttentionOnlyTransformer(cfg)
before = losses_on_repeats(model)
with torch.no_grad():
    untrained_k = k_composition_scores(model, 0, 1)  # for the end
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
batches = torch.Generator().manual_seed(0)
set_fast_path(model, True)  # PyTorch's fused attention while training
for _ in range(600):
    batch = copying_batch(16, cfg.n_ctx + 1, cfg.d_vocab, generator=batches)
    loss = lm_loss(model(batch[:, :-1]), batch[:, 1:])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
set_fast_path(model, False)  # the einsum path: the patterns pass their hook points again
after = losses_on_repeats(model)
print(f"loss on the first repeat, second repeat: untrained {before[0]:.2f}, {before[1]:.2f}; "
      f"trained {after[0]:.2f}, {after[1]:.2f} (ln d_vocab = {math.log(cfg.d_vocab):.2f})")
assert abs(before[1] - math.log(cfg.d_vocab)) < 0.5, "untrained: no better than a uniform guess"
assert after[1] < after[0] - 2.0, "trained: the second repeat costs far less than the first"

# %% [markdown]
# Now your detectors on the trained model's patterns, layer by layer. They must give the
# course's scores (to 1e-6), and they say which head is which:

# %% [check] tags=nbval-ignore-output
names = [f"blocks.{layer}.attn.hook_pattern" for layer in layers]
_, cache = run_with_cache(model, repeated, names)
scores = {  # yours, layer by layer: (layer, head)
    "previous token": torch.stack([prev_token_scores(cache[name]) for name in names]),
    "first token": torch.stack([first_token_scores(cache[name]) for name in names]),
    "induction": torch.stack([induction_scores(cache[name], seg_len) for name in names]),
}
course = {
    "previous token": [head_detectors.prev_token_scores(cache[name]) for name in names],
    "first token": [head_detectors.first_token_scores(cache[name]) for name in names],
    "induction": [head_detectors.induction_scores(cache[name], seg_len) for name in names],
}
for kind, table in scores.items():
    assert torch.allclose(table, torch.stack(course[kind]), atol=1e-6), f"your {kind} scores"
induction_head = divmod(int(scores["induction"].argmax()), cfg.n_heads)
previous_head = divmod(int(scores["previous token"][0].argmax()), cfg.n_heads)
print(f"induction head L{induction_head[0]}H{induction_head[1]} "
      f"(score {scores['induction'].max():.2f}); previous-token head "
      f"L{previous_head[0]}H{previous_head[1]} (score {scores['previous token'][0].max():.2f})")
assert induction_head[0] == 1, "the induction head is in layer 1"
assert (scores["induction"][1] > 0.5).all(), "both layer-1 heads mostly attend to the next token"
assert scores["previous token"][0].max() > 0.3, "layer 0 has a previous-token head"

fig, axes = plt.subplots(1, 3, figsize=(6.4, 2.4), sharey=True, layout="constrained")
for ax, (kind, table) in zip(axes, scores.items()):
    image = ax.imshow(table, vmin=0, vmax=1, cmap="Blues")
    ax.set(title=kind, xlabel="head", xticks=range(cfg.n_heads), yticks=list(layers))
axes[0].set_ylabel("layer")
fig.colorbar(image, ax=axes, label="mean attention")
plt.show()

# %% [markdown]
# Both heads of layer 1 became induction heads, and one head of layer 0 a previous-token
# head. Which of them does the model need? Remove each in turn with your `ablation_hook` and
# your `run_with_hooks`, and measure the loss on the second repeat:

# %% [check] tags=nbval-ignore-output
def second_repeat_loss(logits):
    return repeat_losses(per_token_loss(logits, repeated), seg_len)[1].mean().item()


ablated = torch.zeros(cfg.n_layers, cfg.n_heads)
for layer in layers:
    for head in range(cfg.n_heads):
        hook = {f"blocks.{layer}.attn.hook_z": ablation_hook([head])}
        ablated[layer, head] = second_repeat_loss(run_with_hooks(model, repeated, hook))
print(f"second-repeat loss {after[1]:.2f}; with one head zero-ablated:")
show_table(["layer", *(f"head {h}" for h in range(cfg.n_heads))],
           [[layer, *(f"{x:.2f}" for x in ablated[layer])] for layer in layers])
assert ablated[previous_head] > after[1] + 0.5, "removing the previous-token head hurts"
assert (ablated[1] > after[1] + 0.5).all(), "removing either induction head hurts too"

# %% [markdown]
# Each induction head does part of the copying, so removing one costs some of it. The
# previous-token head is usually a single point of failure, the head whose removal hurts most:
# both induction heads find the token to copy through it (their keys read it). (In some runs
# two heads of layer 0 share that work, and neither alone is decisive.)
#
# Where does the logit of the right token come from? Your `logit_attribution` on the second
# repeat (this model has no final norm, so no scale to freeze), the shares summed over the
# second repeat's positions and the batch:

# %% [check] tags=nbval-ignore-output
logits, cache = run_with_cache(model, repeated, attribution_names(model))
with torch.no_grad():
    shares, labels = logit_attribution(model, cache, repeated)
right = logits[:, :-1].gather(-1, repeated[:, 1:, None])[..., 0]
assert torch.allclose(shares.sum(0), right, atol=1e-4), "the shares sum to the logit"
mean_share = shares[:, :, -(seg_len - 1):].mean(dim=(1, 2))
print("mean share of the right token's logit on the second repeat:",
      ", ".join(f"{label} {share:.2f}" for label, share in zip(labels, mean_share)))
share = dict(zip(labels, mean_share.tolist()))
assert all(share[f"L1H{h}"] > 1.0 for h in range(cfg.n_heads)), "layer 1's heads write it"
assert all(abs(share[f"L0H{h}"]) < 0.5 for h in range(cfg.n_heads)), "layer 0's heads do not"

# %% [markdown]
# The layer-1 heads write the answer; the previous-token head writes nothing the unembedding
# reads directly: its work is for the layer-1 heads' keys.
#
# Now patching. The clean input is a repeated segment; the corrupted one changes the token
# at position `j` of the first repeat. At the position of the second repeat where the model
# should copy it (`seg_len + j - 1`, where the token before it came round again), the clean
# run predicts the clean token and the corrupted run the corrupted one; the metric is their
# logit difference. Your `patch_residual` and `patch_head_all_pos`, as a fraction of the way
# from the corrupted metric (0) to the clean one (1):

# %% [check] tags=nbval-ignore-output
j = 6
clean = repeated[:8, : seg_len + j]  # up to the position that copies
corrupted = clean.clone()
corrupted[:, j] = (clean[:, j] + 1) % cfg.d_vocab
metric = lambda logits: logit_difference(logits, clean[:, j], corrupted[:, j])
with evaluating(model):
    clean_metric, corrupted_metric = metric(model(clean)), metric(model(corrupted))
restored = lambda m: (m - corrupted_metric) / (clean_metric - corrupted_metric)
by_position = restored(patch_residual(model, clean, corrupted, metric))
by_head = restored(patch_head_all_pos(model, clean, corrupted, metric))
print(f"logit difference: clean {clean_metric:.2f}, corrupted {corrupted_metric:.2f}; "
      "share of it restored by patching each head:")
show_table(["layer", *(f"head {h}" for h in range(cfg.n_heads))],
           [[layer, *(f"{x:.2f}" for x in by_head[layer])] for layer in layers])
others = torch.ones_like(by_position, dtype=torch.bool)
others[:, j] = False
assert (by_position[:, j] > 0.8).all(), "the corrupted position carries it into each layer"
assert by_position[0][others[0]].abs().max() < 0.05, "no other position's embedding matters"
assert by_head[1].sum() > 0.8, "layer 1's heads carry it to the answer"
assert abs(by_head[previous_head]) < 0.1, "the previous-token head carries none of it"

fig, ax = plt.subplots(figsize=(6.4, 2.2), layout="constrained")
image = ax.imshow(by_position, cmap="RdBu", vmin=-1, vmax=1, aspect="auto")
ax.set(xlabel="position patched", ylabel="layer (resid_pre)", yticks=list(layers),
       xticks=range(0, clean.shape[1], 3))
fig.colorbar(image, label="share of the clean metric restored")
plt.show()

# %% [markdown]
# The induction heads read the corrupted token's *value* at position `j`, and only there.
# The previous-token head's output differs between the runs only at position `j + 1` (whose
# previous token changed), a key this query never looks for: it looks for the position after
# the earlier occurrence of its own token, which is `j`. So patching that head restores
# nothing. Ablation and patching ask different questions: the previous-token head is needed,
# but it does not carry *this* difference.
#
# Last, the weights: your `k_composition_scores` of layer 0's heads with layer 1's, after
# training and before it (untrained weights score 0.16 to 0.20 across seeds). The
# previous-token head's output is what the induction heads' keys learned to read.

# %% [check] tags=nbval-ignore-output
with torch.no_grad():
    k_scores = k_composition_scores(model, 0, 1)
print("K-composition of layer 0's heads (rows) with layer 1's (columns), trained:")
show_table(["layer-0 head", *(f"head {h}" for h in range(cfg.n_heads))],
           [[a, *(f"{x:.2f}" for x in k_scores[a])] for a in range(cfg.n_heads)])
print(f"before training: at most {untrained_k.max():.2f}")
assert k_scores[previous_head[1]].mean() > untrained_k.max(), (
    "layer 1's keys compose with the previous-token head more than any untrained pair"
)

# %% [markdown]
# ## Inside your chapter 6 GPT-2
#
# The detectors read nothing but `hook_pattern`, so they run unchanged on any course model.
# Workbook 6 kept the GPT-2 you trained on Tiny Shakespeare (`keep_model`, after its
# training); `load_model` builds it again with your `GPT2` and the weights it saved. Two
# inputs: 16 windows of the play's held-out text, where the previous-token and first-token
# scores mean what they say (nothing repeats on purpose, so the induction score would not),
# and 16 random character sequences written twice, with the three scores and the loss on each
# repeat. A head counts as one kind when its score, a mean attention weight, is above
# `threshold`. If workbook 6 has not run to its end, the cell says so and stops there.

# %% [check] tags=nbval-ignore-output
threshold = 0.4  # as for the attention-only model
shakespeare_gpt = load_model("chapter_6_gpt2", GPT2, GPT2Config)
n_ctx = 64 if shakespeare_gpt is None else shakespeare_gpt.cfg.n_ctx  # workbook 6's context
half = n_ctx // 2
detectors = {
    "previous token": prev_token_scores,
    "first token": first_token_scores,
    "induction": lambda pattern: induction_scores(pattern, half),
}
even = causal_mask(n_ctx).float()
even = (even / even.sum(-1, keepdim=True))[None, None]  # one head that attends evenly
evenly = {kind: float(detector(even)) for kind, detector in detectors.items()}
assert math.isclose(evenly["previous token"], evenly["first token"], rel_tol=1e-5), (
    "attending evenly, a query weighs its previous key as much as the first"
)
if shakespeare_gpt is not None:
    play = load_text("tinyshakespeare")
    chars = CharTokenizer(play)  # workbook 6's tokenizer: the same text gives the same ids
    assert chars.vocab_size == shakespeare_gpt.cfg.d_vocab, "the model reads these characters"
    held_out = torch.tensor(chars.encode(play[int(0.9 * len(play)) :]))  # workbook 6's split
    inputs = {
        "Shakespeare": held_out[: 16 * n_ctx].view(16, n_ctx),
        "repeated random characters": repeated_tokens(16, half, chars.vocab_size, seed=1),
    }
    gpt_names = [f"blocks.{n}.attn.hook_pattern" for n in range(shakespeare_gpt.cfg.n_layers)]
    tables = {}
    for label, text_tokens in inputs.items():
        text_logits, text_cache = run_with_cache(shakespeare_gpt, text_tokens, gpt_names)
        print(f"on {label}, the heads above {threshold}, and the strongest head of each kind:")
        for kind, detector in detectors.items():
            if kind == "induction" and label == "Shakespeare":
                continue  # the play repeats nothing on purpose
            table = torch.stack([detector(text_cache[name]) for name in gpt_names])
            assert ((table >= 0) & (table <= 1 + 1e-6)).all(), f"{kind}: a mean attention weight"
            tables[label, kind] = table
            heads = [f"L{layer}H{head} {table[layer, head]:.2f}"
                     for layer, head in (table > threshold).nonzero()]
            layer, head = divmod(int(table.argmax()), table.shape[1])
            print(f"  {kind}: {', '.join(heads) or 'none'}; strongest L{layer}H{head} "
                  f"{table.max():.2f} (a head that attends evenly: {evenly[kind]:.2f})")
    first, second = repeat_losses(per_token_loss(text_logits, text_tokens), half)
    print(f"loss on the repeated random characters: first repeat {first.mean():.2f}, "
          f"second {second.mean():.2f} (a uniform guess: {math.log(chars.vocab_size):.2f})")
    assert tables["Shakespeare", "previous token"].max() > 2 * evenly["previous token"], (
        "on the play, some head attends to the previous character well above even attention"
    )

# %% [markdown]
# The table of your parts, chapters 1 to 10:

# %% tags=nbval-ignore-output
whose = whose_parts(globals(), chapter=10)

# %% [markdown]
# ## More to try
#
# - Train with `init_range=0.02` (GPT-2's) and log the induction scores every 50 steps: when
#   does the phase change come? The book page plots it.
# - Mean-ablate instead of zero-ablating (`mean_z` gives the means): do the numbers change?
# - Patch each head at each position (`patch_head_by_pos`): where does the previous-token
#   head matter once the corruption changes the token *before* position `j` instead?
# - Train your chapter 6 GPT-2 longer (workbook 6 under `COURSE_PROFILE=full`) and run the
#   last section again: which heads appear, and does the second repeat get cheaper?
