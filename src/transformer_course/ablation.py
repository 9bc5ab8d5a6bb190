"""Ablation: remove a head and see what the model loses.

A head's whole effect on the rest of the model goes through its `z` (`blocks.{l}.attn.hook_z`,
`(batch, pos, head, d_head)`: its attention-weighted values, before `W_O`). A hook that replaces
one head's `z` removes the head: *zero-ablation* puts zeros there (the head writes nothing),
*mean-ablation* the head's mean `z` at each position over the batch (the head writes what it
writes on average, so only its dependence on this input is removed: the gentler test, since
zero may be far from anything the head ever writes). The loss with each head removed in turn
says which heads the behaviour needs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.head_detectors import per_token_loss
from transformer_course.hooks import Hook, run_with_cache, run_with_hooks

__all__ = ["KINDS", "ablation_hook", "mean_z", "head_ablation_losses"]

KINDS = ("zero", "mean")
LossFn = Callable[[Tensor, Tensor], Tensor]  # (logits, tokens) -> a scalar loss


def ablation_hook(
    heads: Sequence[int], kind: str = "zero", mean: Float[Tensor, "pos head d_head"] | None = None
) -> Hook:
    """A hook for `hook_z` that replaces the `z` of `heads` by zeros (`kind="zero"`) or by
    `mean` at each position (`kind="mean"`, e.g. from `mean_z`), and returns the edited `z`;
    the others heads' `z` and the tensor it was given stay as they were.

    Course: chapter 10, exercise 10.7, checked by checks.interpretability.check_ablation_hook.
    """
    validate.one_of("kind", kind, KINDS)
    heads = [validate.integer("head", head, low=0) for head in heads]
    if (kind == "mean") != (mean is not None):
        raise ValueError(f"mean: expected a tensor exactly when kind='mean', got kind={kind!r}")

    def hook(z: Float[Tensor, "batch pos head d_head"], hook=None) -> Tensor:
        if max(heads, default=-1) >= z.shape[2]:
            raise ValueError(f"heads: expected indices below {z.shape[2]}, got {heads}")
        z = z.clone()
        if kind == "zero":
            z[:, :, heads] = 0.0
        else:
            z[:, :, heads] = mean[: z.shape[1], heads].to(z.dtype)
        return z

    return hook


def mean_z(
    model: HookedRootModule, tokens: Int[Tensor, "batch pos"], layer: int
) -> Float[Tensor, "pos head d_head"]:
    """Every head's `z` of `layer` averaged over the batch of `tokens`, at each position."""
    validate.integer("layer", layer, low=0, high=model.cfg.n_layers - 1)
    name = f"blocks.{layer}.attn.hook_z"
    _, cache = run_with_cache(model, tokens, [name])
    return cache[name].mean(dim=0)


def mean_next_token_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """The mean next-token loss over every position."""
    return per_token_loss(logits, tokens).mean()


def head_ablation_losses(
    model: HookedRootModule,
    tokens: Int[Tensor, "batch pos"],
    *,
    kind: str = "zero",
    loss_fn: LossFn = mean_next_token_loss,
) -> Float[Tensor, "layer head"]:
    """`loss_fn(logits, tokens)` with each head ablated in turn (one at a time): entry
    `[layer, head]`; compare it with the loss of the intact model. Mean-ablation uses each
    head's mean `z` over this batch.

    Course: chapter 10.
    """
    validate.one_of("kind", kind, KINDS)
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    losses = torch.zeros(n_layers, n_heads, dtype=torch.float64)
    for layer in range(n_layers):
        mean = mean_z(model, tokens, layer) if kind == "mean" else None
        for head in range(n_heads):
            hook = ablation_hook([head], kind, mean)
            logits = run_with_hooks(model, tokens, {f"blocks.{layer}.attn.hook_z": hook})
            losses[layer, head] = float(loss_fn(logits, tokens))
    return losses
