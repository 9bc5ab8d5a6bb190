"""Checkers for chapter 10's workbook (10_interpretability): the head detectors, direct logit
attribution, the ablation hook and residual-stream patching, each against the course's
reference on a small random-weight GPT-2 in float64, with the classic mistakes named."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from transformer_course import attribution, head_detectors, hooks, patching
from transformer_course.checks.harness import (
    call,
    expect,
    expect_close,
    expect_unchanged,
    passed,
    randn,
    seeded,
)
from transformer_course.gpt2 import GPT2, GPT2Config

SEG_LEN = 5  # patterns of [BOS, x(5), x(5)]: 11 positions


def _pattern(seed: int = 0, pos: int = 2 * SEG_LEN + 1) -> Tensor:
    """Causal softmax patterns (batch 2, head 3) in float64, rows that differ."""
    scores = 3 * randn(2, 3, pos, pos, seed=seed)
    allowed = torch.ones(pos, pos, dtype=torch.bool).tril()
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1)


def _model() -> GPT2:
    """A tiny GPT-2 in float64 with every parameter (norms and biases too) randomised."""
    torch.manual_seed(0)
    model = GPT2(GPT2Config(d_model=16, n_layers=2, n_heads=2, d_vocab=23, n_ctx=16)).double()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=seeded(1), dtype=param.dtype))
    return model.eval()


def _diagonal_mean(pattern: Tensor, offset: int, queries: int) -> Tensor:
    """Mean over batch and the last `queries` queries of the diagonal at `offset`."""
    return pattern.diagonal(offset=offset, dim1=-2, dim2=-1)[..., -queries:].mean(dim=(0, -1))


def check_prev_token_scores(fn: Callable) -> None:
    """`prev_token_scores(pattern)` against the reference: 1e-12 in float64."""
    name, pattern = "prev_token_scores", _pattern()
    mistakes = {
        "that is the diagonal itself (each token attending to itself): use offset=-1.": (
            _diagonal_mean(pattern, 0, 10)
        ),
    }
    given = pattern.clone()
    actual = call(name, fn, given)
    expected = head_detectors.prev_token_scores(pattern)
    hint = "pattern.diagonal(offset=-1, dim1=-2, dim2=-1), then the mean over batch and queries."
    expect_close(actual, expected, name, hint, atol=1e-12, rtol=0, mistakes=mistakes)
    expect_unchanged(name, given, pattern)
    passed(name)


def check_first_token_scores(fn: Callable) -> None:
    """`first_token_scores(pattern)` against the reference: 1e-12 in float64."""
    name, pattern = "first_token_scores", _pattern(1)
    mistakes = {
        "query 0 can only attend to itself: leave it out (queries 1 ..).": (
            pattern[..., 0].mean(dim=(0, -1))
        ),
        "that is the last key; the first token is key 0: pattern[:, :, 1:, 0].": (
            pattern[:, :, 1:, -1].mean(dim=(0, -1))
        ),
    }
    actual = call(name, fn, pattern.clone())
    expected = head_detectors.first_token_scores(pattern)
    hint = "pattern[:, :, 1:, 0] averaged over batch and queries."
    expect_close(actual, expected, name, hint, atol=1e-12, rtol=0, mistakes=mistakes)
    passed(name)


def check_induction_scores(fn: Callable) -> None:
    """`induction_scores(pattern, seg_len)` against the reference, with BOS and without:
    1e-12 in float64; the diagonal read at another offset is named."""
    name = "induction_scores"
    hint = "the diagonal at offset -(seg_len - 1), its last seg_len entries (the second repeat)."
    for pos, seed in ((2 * SEG_LEN + 1, 2), (2 * SEG_LEN, 3)):
        pattern = _pattern(seed, pos)
        mistakes = {
            "that is the earlier occurrence itself (a duplicate-token head): the induction head "
            "attends to the token after it, offset -(seg_len - 1).": (
                _diagonal_mean(pattern, -SEG_LEN, SEG_LEN)
            ),
            "one off: the token after the earlier occurrence is seg_len - 1 back.": (
                _diagonal_mean(pattern, -SEG_LEN - 1, SEG_LEN - 1)
            ),
            "average the second repeat only (the last seg_len queries), not the whole diagonal.": (
                pattern.diagonal(offset=-(SEG_LEN - 1), dim1=-2, dim2=-1).mean(dim=(0, -1))
            ),
        }
        where = f"{name} ({'with' if pos % 2 else 'without'} BOS)"
        actual = call(where, fn, pattern.clone(), SEG_LEN)
        expected = head_detectors.induction_scores(pattern, SEG_LEN)
        expect_close(actual, expected, where, hint, atol=1e-12, rtol=0, mistakes=mistakes)
    passed(name)


def check_logit_attribution(fn: Callable) -> None:
    """`logit_attribution(model, cache, tokens)`: the parts and their names as the reference's,
    1e-10 in float64; the parts sum to the logit; the final norm's scale frozen."""
    name, model = "logit_attribution", _model()
    tokens = torch.randint(0, 23, (3, 7), generator=seeded(2))
    logits, cache = hooks.run_with_cache(model, tokens, attribution.attribution_names(model))
    expected, labels = attribution.logit_attribution(model, cache, tokens)
    unscaled = dict(cache, **{"ln_final.hook_scale": torch.ones_like(cache["ln_final.hook_scale"])})
    mistakes = {
        "the final norm's scale is missing: divide each centred part by the scale the run "
        "used (cache['ln_final.hook_scale']), frozen, as the norm did to their sum.": (
            attribution.logit_attribution(model, unscaled, tokens)[0]
        ),
    }
    result = call(name, fn, model, dict(cache), tokens)
    expect(
        isinstance(result, tuple) and len(result) == 2,
        name,
        "expected (shares, labels).",
    )
    shares, got_labels = result
    expect(list(got_labels) == labels, name, f"expected the labels {labels}, got {got_labels}.")
    hint = "(part - its mean) / scale * w @ W_U[:, next token], and a bias part b @ W_U + b_U."
    expect_close(shares, expected, name, hint, atol=1e-10, rtol=0, mistakes=mistakes)
    passed(name)


def check_ablation_hook(fn: Callable) -> None:
    """`ablation_hook(heads, kind, mean)` against the reference on a `z` (batch, pos, head,
    d_head): exact; a hook that returns nothing is named."""
    name, z = "ablation_hook", randn(2, 5, 3, 4, seed=4)
    mean = z.mean(0)
    for heads, kind, avg in (([1], "zero", None), ([0, 2], "mean", mean)):
        where = f"{name}({heads}, {kind!r})"
        hook = call(where, fn, heads, kind, avg)
        given = z.clone()
        out = call(f"the hook of {where}", hook, given, None)
        expect(
            isinstance(out, Tensor),
            where,
            f"the hook returned {type(out).__name__}.",
            "return the edited z: TransformerLens uses what a hook returns; an edit of a copy "
            "that is not returned is lost (and an in-place edit also changes the cache's copy).",
        )
        expect_unchanged(where, given, z)
        expected = z.clone()
        expected[:, :, heads] = 0.0 if kind == "zero" else mean[:, heads]
        expect_close(out, expected, where, "replace only those heads' z.", atol=0, rtol=0)
    passed(name)


def check_patch_residual(fn: Callable) -> None:
    """`patch_residual(model, clean, corrupted, metric)` against the reference: 1e-6; patching
    every position, or the next one, is named."""
    name, model = "patch_residual", _model()
    clean = torch.randint(0, 23, (2, 5), generator=seeded(5))
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % 23
    metric = lambda logits: patching.logit_difference(logits, clean[:, 2], corrupted[:, 2])  # noqa: E731
    expected = patching.patch_residual(model, clean, corrupted, metric)
    _, cache = hooks.run_with_cache(model, clean)
    every = torch.stack(
        [
            torch.tensor(
                float(
                    metric(hooks.run_with_hooks(model, corrupted, {n: lambda a, h, n=n: cache[n]}))
                )
            ).expand(5)
            for n in (f"blocks.{layer}.hook_resid_pre" for layer in range(2))
        ]
    )
    mistakes = {
        "every position patched at once: patch only [:, position] for each entry.": every,
        "the wrong position: entry [layer, p] patches position p.": torch.cat(
            [expected[:, 1:], expected[:, -1:]], dim=1
        ),
    }
    actual = call(name, fn, model, clean, corrupted, metric)
    hint = "clone the corrupted activation, copy clean[:, p] into [:, p], return it."
    expect_close(actual, expected, name, hint, atol=1e-6, rtol=0, mistakes=mistakes)
    passed(name)
