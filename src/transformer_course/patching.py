"""Activation patching: which activations carry the information that changes the answer.

Run the model on a *clean* input and on a *corrupted* one that differs where it matters (the
same number of tokens, so positions line up), with a metric of the output such as the logit
difference between the clean answer and the corrupted one. Then run the corrupted input again,
each time with one activation taken from the clean run: where that restores the clean metric,
that activation (a layer's residual stream at one position, one head's output) carries what
the corruption destroyed (Meng et al., 2022; Wang et al., 2023; ARENA 1.3).

Results equal `transformer_lens.patching`'s `get_act_patch_resid_pre`,
`get_act_patch_attn_head_out_by_pos` and `get_act_patch_attn_head_out_all_pos` (head outputs
are patched at `hook_z`, as there) on the same model and inputs, on the same device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.hooks import run_with_cache, run_with_hooks

__all__ = ["logit_difference", "patch_residual", "patch_head_by_pos", "patch_head_all_pos"]

Metric = Callable[[Tensor], Tensor]  # logits -> a scalar


def logit_difference(
    logits: Float[Tensor, "batch pos d_vocab"],
    correct: Int[Tensor, " batch"],
    wrong: Int[Tensor, " batch"],
    *,
    position: int = -1,
) -> Float[Tensor, ""]:
    """The logit of each row's `correct` token minus that of its `wrong` token at `position`,
    averaged over the batch.

    Course: chapter 10.
    """
    for name, ids in (("correct", correct), ("wrong", wrong)):
        validate.same_batch(name, ids, logits, "logits")
    last = logits[:, position]
    rows = torch.arange(logits.shape[0], device=logits.device)
    return (last[rows, correct] - last[rows, wrong]).mean()


def _clean_cache(model, clean_tokens: Tensor, corrupted_tokens: Tensor, names: list[str]):
    """The clean run's activations `names`, once both inputs have the same shape."""
    for name, tokens in (("clean_tokens", clean_tokens), ("corrupted_tokens", corrupted_tokens)):
        validate.token_tensor(name, tokens, model.cfg.d_vocab)
    if clean_tokens.shape != corrupted_tokens.shape:
        raise ValueError(
            f"corrupted_tokens: expected the clean run's shape {tuple(clean_tokens.shape)} "
            f"(positions must line up to patch), got {tuple(corrupted_tokens.shape)}"
        )
    return run_with_cache(model, clean_tokens, names)[1]


def _patched(model, tokens: Tensor, name: str, clean: Tensor, where: tuple, metric: Metric):
    """The metric of the run on `tokens` with `clean[where]` put into `name`'s activation."""

    def hook(act: Tensor, hook=None) -> Tensor:
        act = act.clone()
        act[where] = clean[where]
        return act

    return float(metric(run_with_hooks(model, tokens, {name: hook})))


def patch_residual(
    model: HookedRootModule,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Metric,
) -> Float[Tensor, "layer pos"]:
    """The metric of the corrupted run with the residual stream entering layer `l`
    (`blocks.{l}.hook_resid_pre`) at position `p` taken from the clean run: entry `[l, p]`.

    Course: chapter 10, exercise 10.8, checked by checks.interpretability.check_patch_residual.
    """
    n_layers, pos = model.cfg.n_layers, clean_tokens.shape[-1]
    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(n_layers)]
    clean = _clean_cache(model, clean_tokens, corrupted_tokens, names)
    results = torch.zeros(n_layers, pos, device=clean_tokens.device)
    for layer, name in enumerate(names):
        for p in range(pos):
            where = (slice(None), p)
            results[layer, p] = _patched(model, corrupted_tokens, name, clean[name], where, metric)
    return results


def patch_head_by_pos(
    model: HookedRootModule,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Metric,
) -> Float[Tensor, "layer pos head"]:
    """The metric of the corrupted run with head `h` of layer `l` at position `p` (its `z`)
    taken from the clean run: entry `[l, p, h]`.

    Course: chapter 10.
    """
    n_layers, n_heads, pos = model.cfg.n_layers, model.cfg.n_heads, clean_tokens.shape[-1]
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(n_layers)]
    clean = _clean_cache(model, clean_tokens, corrupted_tokens, names)
    results = torch.zeros(n_layers, pos, n_heads, device=clean_tokens.device)
    for layer, name in enumerate(names):
        for p in range(pos):
            for head in range(n_heads):
                where = (slice(None), p, head)
                value = _patched(model, corrupted_tokens, name, clean[name], where, metric)
                results[layer, p, head] = value
    return results


def patch_head_all_pos(
    model: HookedRootModule,
    clean_tokens: Int[Tensor, "batch pos"],
    corrupted_tokens: Int[Tensor, "batch pos"],
    metric: Metric,
) -> Float[Tensor, "layer head"]:
    """The metric of the corrupted run with head `h` of layer `l` (its `z` at every position)
    taken from the clean run: entry `[l, h]`.

    Course: chapter 10, exercise 10.9, checked by checks.interpretability.check_patch_head_all_pos.
    """
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(n_layers)]
    clean = _clean_cache(model, clean_tokens, corrupted_tokens, names)
    results = torch.zeros(n_layers, n_heads, device=clean_tokens.device)
    for layer, name in enumerate(names):
        for head in range(n_heads):
            where = (slice(None), slice(None), head)
            results[layer, head] = _patched(
                model, corrupted_tokens, name, clean[name], where, metric
            )
    return results
