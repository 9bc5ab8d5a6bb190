"""Checkers for chapter 10's workbook (10_interpretability): running with hooks, the head
detectors, the loss on each repeat, direct logit attribution, the ablation hook, residual-stream
and per-head patching and K-composition, each against the course's reference on a small
random-weight GPT-2 in float64, with the classic mistakes named."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from transformer_course import attribution, circuits, head_detectors, hooks, patching
from transformer_course.checks.harness import (
    call,
    expect,
    expect_close,
    expect_evaluating,
    expect_raises,
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


def _scale(act: Tensor, hook=None) -> Tensor:
    """A hook that replaces an activation by a rescaled copy (no norm undoes it)."""
    return act * torch.linspace(0.5, 1.5, act.shape[-1], dtype=act.dtype)


def _zero_head_0(z: Tensor, hook=None) -> Tensor:
    """A hook on `hook_z` that removes head 0."""
    z = z.clone()
    z[:, :, 0] = 0.0
    return z


def _forgets(act: Tensor, hook=None) -> None:
    """A hook that edits a copy and returns nothing."""
    act.clone().zero_()


def check_run_with_hooks(fn: Callable) -> None:
    """`run_with_hooks(model, tokens, hooks)`: the reference's logits with the same hooks, 1e-10
    in float64, in eval mode without gradients and with no hook left behind; a misspelt name
    and a hook that returns nothing refused."""
    name, model = "run_with_hooks", _model()
    tokens = torch.randint(0, 23, (2, 6), generator=seeded(6))
    edits = {"blocks.0.hook_resid_post": _scale, "blocks.1.attn.hook_z": _zero_head_0}
    expected = hooks.run_with_hooks(model, tokens, edits)
    with torch.no_grad():
        plain = model(tokens)
    actual = expect_evaluating(name, fn, model, tokens, dict(edits))
    mistakes = {
        "the hooks changed nothing: hand them to the model's run_with_hooks as fwd_hooks, "
        "a list of (name, function) pairs.": plain
    }
    hint = "model.run_with_hooks(tokens, fwd_hooks=[(name, fn), ...]) in eval mode, no_grad."
    expect_close(actual, expected, name, hint, atol=1e-10, rtol=0, mistakes=mistakes)
    with torch.no_grad():
        after = model.eval()(tokens)
    left = "the hooks stayed on the model: a later plain run is still edited."
    expect(torch.equal(after, plain), name, left, "model.run_with_hooks removes them after.")
    misspelt = {"blocks.0.hook_resid_psot": _scale}
    hint = "check every name against hook_names(model) first: a KeyError that names it."
    expect_raises(
        f"{name} with a misspelt name", hint, fn, model, tokens, misspelt, errors=(KeyError,)
    )
    hint = "wrap each hook: if what it returns is not a tensor of the activation's shape, raise."
    nothing = {"blocks.0.hook_resid_pre": _forgets}
    where = f"{name} with a hook that returns nothing"
    expect_raises(where, hint, fn, model, tokens, nothing, errors=(ValueError, TypeError))
    passed(name)


def check_repeat_losses(fn: Callable) -> None:
    """`repeat_losses(loss, seg_len)` against the reference, with BOS and without: exact slices
    (1e-12); a repeat's unpredictable first token, or a slice one off, named."""
    name = "repeat_losses"
    hint = "entry i of the loss predicts token i + 1; each repeat's first token is left out."
    first_token = (
        "nothing predicts a repeat's first token (the segment is random): leave its loss out, "
        "seg_len - 1 losses per repeat."
    )
    for pos, seed in ((2 * SEG_LEN + 1, 7), (2 * SEG_LEN, 8)):
        loss = randn(2, pos - 1, seed=seed).abs()
        where = f"{name} ({'with' if pos % 2 else 'without'} BOS)"
        result = call(where, fn, loss.clone(), SEG_LEN)
        expect(isinstance(result, tuple) and len(result) == 2, where, "expected (first, second).")
        expected = head_detectors.repeat_losses(loss, SEG_LEN)
        wrong = {
            "first": {
                "with BOS, entry 0 is the loss of the segment's first token (predicted from "
                "BOS): count the repeats from the end, the second ends the sequence.": loss[
                    :, : SEG_LEN - 1
                ],
            },
            "second": {
                "one off: the second repeat's predicted tokens are the last seg_len - 1 "
                "entries of the loss.": loss[:, -SEG_LEN:-1],
            },
        }
        for (what, mistakes), got, want in zip(wrong.items(), result, expected):
            repeat = f"{where}, the {what} repeat"
            if isinstance(got, Tensor) and tuple(got.shape) == (2, SEG_LEN):
                expect(
                    False, repeat, f"expected shape {tuple(want.shape)}, got (2, 5).", first_token
                )
            expect_close(got, want, repeat, hint, atol=1e-12, rtol=0, mistakes=mistakes)
    passed(name)


def _patching_case() -> tuple:
    """The tiny model, clean and corrupted tokens (one token changed) and a logit difference."""
    model = _model()
    clean = torch.randint(0, 23, (2, 5), generator=seeded(5))
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1) % 23
    metric = lambda logits: patching.logit_difference(logits, clean[:, 2], corrupted[:, 2])  # noqa: E731
    return model, clean, corrupted, metric


def check_patch_head_all_pos(fn: Callable) -> None:
    """`patch_head_all_pos(model, clean, corrupted, metric)` against the reference: 1e-6; every
    head patched at once, or positions patched instead of heads, named."""
    name = "patch_head_all_pos"
    model, clean, corrupted, metric = _patching_case()
    expected = patching.patch_head_all_pos(model, clean, corrupted, metric)
    names = [f"blocks.{layer}.attn.hook_z" for layer in range(2)]
    _, cache = hooks.run_with_cache(model, clean, names)

    def patched(layer: int, where: tuple) -> float:
        return patching._patched(model, corrupted, names[layer], cache[names[layer]], where, metric)

    every = torch.tensor([[patched(layer, (slice(None),))] * 2 for layer in range(2)])
    position = torch.tensor(
        [[patched(layer, (slice(None), h)) for h in range(2)] for layer in range(2)]
    )
    mistakes = {
        "every head patched at once: entry [layer, h] patches head h alone.": every,
        "that patches position h: z is (batch, pos, head, d_head), head h is [:, :, h].": (
            position
        ),
    }
    actual = call(name, fn, model, clean, corrupted, metric)
    hint = "for each layer and head, clone the corrupted z, copy clean[:, :, h] into [:, :, h]."
    expect_close(actual, expected, name, hint, atol=1e-6, rtol=0, mistakes=mistakes)
    passed(name)


def check_k_composition_scores(fn: Callable) -> None:
    """`k_composition_scores(model, layer_a, layer_b)` against the reference (equal to
    TransformerLens's `all_composition_scores("K")`): 1e-10 in float64; Q- and V-composition,
    the transpose left out and the norms left out named."""
    name, model = "k_composition_scores", _model()
    expected = circuits.k_composition_scores(model, 0, 1)
    W_OV = torch.stack([circuits.ov_circuit(model, 0, h) for h in range(2)])[:, None]
    W_QK = torch.stack([circuits.qk_circuit(model, 1, h) for h in range(2)])[None]
    W_OV_B = torch.stack([circuits.ov_circuit(model, 1, h) for h in range(2)])[None]
    norm = torch.linalg.matrix_norm
    mistakes = {
        "that is Q-composition (A's output read by B's queries): K-composition puts A's OV on "
        "the key side, W_QK_B @ W_OV_A.T.": circuits.composition_score(W_OV, W_QK),
        "that is V-composition (W_OV_A @ W_OV_B): K-composition reads A's output with B's "
        "keys.": circuits.composition_score(W_OV, W_OV_B),
        "the keys read A's output as rows: W_QK_B @ W_OV_A.T, with the transpose.": (
            circuits.composition_score(W_QK, W_OV)
        ),
        "divide by the two matrices' norms: the score compares the product with its largest "
        "possible size.": norm(W_QK @ W_OV.transpose(-1, -2)),
        "entry [a, b] is head a of layer_a with head b of layer_b, not the transpose.": (
            expected.T
        ),
    }
    actual = call(name, fn, model, 0, 1)
    hint = "||W_QK_B @ W_OV_A.T||_F / (||W_QK_B||_F ||W_OV_A||_F) for every pair of heads."
    expect_close(actual, expected, name, hint, atol=1e-10, rtol=0, mistakes=mistakes)
    passed(name)
