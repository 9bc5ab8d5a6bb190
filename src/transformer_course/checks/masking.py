"""Checkers for chapter 3's workbook (03_masking): causal mask, padding mask, combined masks, safe
masked softmax."""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce

import torch

from transformer_course import masking
from transformer_course.checks.harness import (
    CONVENTION_HINT,
    OVERFLOW_HINT,
    call,
    describe,
    expect,
    expect_close,
    expect_mask_not_inverted,
    expect_raises,
    passed,
)

AND_HINT = (
    "a query may attend to a key only if *every* mask allows it: combine with AND (`&`, "
    "`torch.logical_and`), not OR (`|`)."
)
BROADCAST_HINT = (
    "let the masks broadcast against each other: (q_pos, k_pos) & (batch, 1, 1, k_pos) is "
    "(batch, 1, q_pos, k_pos). `&` broadcasts for you; don't stack, reshape or slice them."
)
NONE_HINT = (
    "`None` means no restriction: skip it. With no mask left (all None, or none) return None."
)
NON_BOOL_HINT = (
    "a 0/1 float or int mask could mean either convention: refuse it with a ValueError, e.g. "
    "`validate.bool_mask(mask, f'masks[{index}]')`."
)
FP16_HINT = (
    "a constant such as -1e9 does not fit in fp16 (its range ends at -65504): fill with "
    "`torch.finfo(scores.dtype).min`."
)


def _expect_bool_mask(actual: object, expected: torch.Tensor, name: str, hint: str) -> None:
    """A bool tensor of the expected shape."""
    expect(isinstance(actual, torch.Tensor), name, f"expected a tensor, got {describe(actual)}.")
    bool_hint = (
        "masks are boolean with True = may attend (e.g. `torch.ones(..., dtype=torch.bool)`)."
    )
    expect(
        actual.dtype == torch.bool, name, f"expected a bool tensor, got {actual.dtype}.", bool_hint
    )
    shape, got = tuple(expected.shape), tuple(actual.shape)
    expect(got == shape, name, f"expected shape {shape}, got {got}.", hint)


def _causal_mistakes(q_len: int, k_len: int) -> dict[str, torch.Tensor]:
    """The masks the classic causal-mask bugs give, keyed by their hint."""
    ones, side = torch.ones(q_len, k_len, dtype=torch.bool), max(q_len, k_len)
    return {
        "the diagonal is excluded: a token may attend to itself, keep the diagonal "
        "(`tril(diagonal=0)` when q_len == k_len).": ones.tril(k_len - q_len - 1),
        "each query also sees the next key, the one it must predict: the diagonal is the last "
        "allowed key.": ones.tril(k_len - q_len + 1),
        "the mask is inverted: True means *may attend*, a query may look at itself and earlier "
        "keys.": ~masking.causal_mask(q_len, k_len),
        f"with k_len={k_len} > q_len={q_len} the queries are the *last* q_len positions: don't "
        "slice the top-left corner of a square mask built for the maximum length; query i sees "
        "keys j <= i + (k_len - q_len).": torch.ones(side, side, dtype=torch.bool).tril()[
            :q_len, :k_len
        ],
    }


def check_causal_mask(fn: Callable[..., torch.Tensor]) -> None:
    """`causal_mask(q_len, k_len=None)`: lower triangle, aligned to the last key when
    k_len > q_len; on the device it is given."""
    name = "causal_mask"
    for args in ((4,), (6, 6), (3, 7), (1, 5), (1,)):
        actual, expected = call(name, fn, *args), masking.causal_mask(*args)
        where = f"{name}{args}".replace(",)", ")")
        hint = "build the mask from the lengths you are given, not from a maximum length."
        _expect_bool_mask(actual, expected, where, hint)
        hint = "query i may attend to key j exactly when j <= i + (k_len - q_len)."
        mistakes = _causal_mistakes(*expected.shape)
        expect_close(actual, expected, where, hint, mistakes=mistakes)
    meta = call(name, fn, 3, 5, device="meta")
    on = getattr(meta, "device", describe(meta))
    hint = "create the tensor with device=device, so the mask lives where the scores live."
    where = f"{name}(3, 5, device='meta')"
    expect(getattr(on, "type", "") == "meta", where, f"the mask is on {on}, not on 'meta'.", hint)
    passed(name)


def check_padding_mask(fn: Callable[..., torch.Tensor]) -> None:
    """`padding_mask(tokens, pad_id)`: (batch, 1, 1, k_pos), False at padding keys."""
    name = "padding_mask"
    for tokens, pad_id in (
        (torch.tensor([[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 9]]), 0),
        (torch.tensor([[3, 3, 50257, 50257]]), 50257),
    ):
        actual, expected = call(name, fn, tokens, pad_id), masking.padding_mask(tokens, pad_id)
        batch, k_len = tokens.shape
        queries = getattr(actual, "shape", None) == (batch, 1, k_len, 1)
        problem, hint = "it masks *queries*, not keys.", "padding is a property of keys: shape "
        hint += "(batch, 1, 1, k_pos), so that every query (and every head) ignores the padding."
        expect(not queries, name, problem, hint)
        _expect_bool_mask(
            actual, expected, name, "add the head and query axes: [:, None, None, :]."
        )
        inverted = (
            "the mask is inverted: real tokens are True, padding is False (tokens != pad_id)."
        )
        hint = (
            "compare tokens with pad_id, then add the head and query axes with [:, None, None, :]."
        )
        expect_close(actual, expected, name, hint, mistakes={inverted: ~expected})
    passed(name)


def _combine_cases() -> list[tuple[str, tuple]]:
    """Labelled argument tuples: masks of different shapes and kinds, in different orders."""
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    causal, padding = masking.causal_mask(5), masking.padding_mask(tokens, 0)
    random = torch.rand(3, 1, 5, 5, generator=torch.Generator().manual_seed(0)) < 0.5
    return [
        ("causal_mask(5), padding_mask(tokens, 0)", (causal, padding)),
        ("padding_mask(tokens, 0), causal_mask(5)", (padding, causal)),
        ("a causal, None and two more masks", (causal, None, padding, random)),
        ("None, then a padding mask", (None, padding)),
        ("a single mask", (random,)),
    ]


def check_combine_masks(fn: Callable[..., torch.Tensor | None]) -> None:
    """`combine_masks(*masks)`: AND of bool masks with broadcasting, None skipped, non-bool
    masks refused, the inputs left as they were."""
    name = "combine_masks"
    for label, masks in _combine_cases():
        where, hint = f"{name}({label})", NONE_HINT if None in masks else BROADCAST_HINT
        actual, expected = call(where, fn, *masks, hint=hint), masking.combine_masks(*masks)
        expect(isinstance(actual, torch.Tensor), where, f"got {describe(actual)}.", hint)
        _expect_bool_mask(actual, expected, where, BROADCAST_HINT)
        present = [mask for mask in masks if mask is not None]
        either = reduce(torch.logical_or, present)
        mistakes = {
            "a key allowed by any one mask is allowed: that is OR. " + AND_HINT: either,
            "the result is inverted. " + CONVENTION_HINT: ~expected,
        }
        expect_close(actual, expected, where, AND_HINT, mistakes=mistakes)
    for masks in ((None, None), ()):
        where = f"{name}({', '.join(map(repr, masks))})"
        actual = call(where, fn, *masks, hint=NONE_HINT)
        expect(actual is None, where, f"expected None, got {describe(actual)}.", NONE_HINT)

    first, second = (
        torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(s)) < 0.5 for s in (1, 2)
    )
    before, where = (first.clone(), second.clone()), f"{name}(two masks of one shape)"
    call(where, fn, first, second, hint=AND_HINT)
    same = torch.equal(first, before[0]) and torch.equal(second, before[1])
    hint = "`combined &= mask` writes into the caller's mask: use `combined = combined & mask`."
    expect(same, where, "an input mask changed: the caller's mask was modified in place.", hint)

    causal, padding = masking.causal_mask(5), masking.padding_mask(torch.ones(2, 5).long(), 0)
    for label, masks in (
        ("a causal mask, an int", (causal, padding.long())),
        ("a float", (causal.float(),)),
    ):
        expect_raises(
            f"{name}({label} 0/1 mask)", NON_BOOL_HINT, fn, *masks, errors=(ValueError, TypeError)
        )
    square = torch.ones(4, 4, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)
    hint = "masks whose shapes don't broadcast can't be combined: raise an error instead of "
    hint += "slicing or expanding one to fit."
    expect_raises(f"{name}(masks of shapes (4, 4) and (3, 3))", hint, fn, *square)
    passed(name)


def _expect_empty_rows_are_zero(name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Rows with no allowed key: zeros and finite gradients, in every dtype."""
    empty = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        scores = torch.randn(3, 4, generator=generator).to(dtype).requires_grad_()
        where = f"{name} ({dtype}, a row with no allowed key)"
        actual = call(where, fn, scores, empty, hint=FP16_HINT if dtype != torch.float32 else "")
        expect(isinstance(actual, torch.Tensor), where, f"got {describe(actual)}.")
        expect_mask_not_inverted(where, actual, empty)
        hint = "softmax over a row that is all -inf is 0/0 = NaN. Fill with a large *finite* "
        hint += "negative number, `torch.finfo(scores.dtype).min`, and zero the empty rows."
        expect(not actual.isnan().any(), where, "the result contains NaN.", hint)
        hint = "with a finite fill an empty row comes out uniform; set the weights of forbidden "
        hint += "keys to 0 after the softmax (`masked_fill(~mask, 0)`)."
        row = actual[1].detach().tolist()
        expect(not any(row), where, f"expected an all-zero pattern row, got {row}.", hint)
        actual.float().pow(2).sum().backward()
        finite = scores.grad is not None and bool(scores.grad.isfinite().all())
        hint = "avoid -inf anywhere in the computation; use a finite fill."
        expect(finite, where, "the gradient contains NaN or inf.", hint)
        reference = masking.masked_softmax(scores.detach(), empty).float()
        expect_close(actual.detach().float(), reference, where, atol=1e-2, rtol=1e-2)


def check_masked_softmax(fn: Callable[..., torch.Tensor]) -> None:
    """`masked_softmax(scores, mask)`: softmax over allowed keys; zeros (never NaN) for empty
    rows; no overflow for large scores; a plain softmax when `mask` is None."""
    name = "masked_softmax"
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 6, generator=generator) < 0.6
    mask[..., 0] = True
    expected, actual = masking.masked_softmax(scores, mask), call(name, fn, scores, mask)
    expect(isinstance(actual, torch.Tensor), name, f"expected a tensor, got {describe(actual)}.")
    expect_mask_not_inverted(name, actual, mask)
    if actual.shape == expected.shape and not actual.isnan().any():
        sums = actual.detach().sum(-1)
        hint = "take the softmax over keys, the last dim (`dim=-1`), not over queries (`dim=-2`)."
        problem = "the weights of a query (a row) do not sum to one."
        expect(torch.allclose(sums, torch.ones_like(sums)), name, problem, hint)
        leaked = actual.detach().masked_fill(mask, 0).abs().max().item()
        hint = "fill forbidden scores with a large negative number *before* the softmax."
        expect(leaked < 1e-6, name, f"forbidden keys get weight (up to {leaked:.3g}).", hint)
    hint = "softmax over the last dim of the filled scores."
    expect_close(actual, expected, name, hint, atol=1e-10, rtol=1e-8)
    for dtype, scale in ((torch.float32, 60.0), (torch.float64, 400.0)):
        scores = (torch.randn(2, 5, 6, generator=generator, dtype=torch.float64) * scale).to(dtype)
        mask = torch.rand(1, 5, 6, generator=generator) < 0.7
        mask[..., 0] = True
        top = scores.abs().max().item()
        where = f"{name} ({str(dtype).replace('torch.', '')} scores up to {top:.0f})"
        actual, expected = call(name, fn, scores, mask), masking.masked_softmax(scores, mask)
        finite = isinstance(actual, torch.Tensor) and bool(actual.isfinite().all())
        expect(finite, where, "the result contains NaN or inf.", OVERFLOW_HINT)
        expect_close(actual, expected, where, OVERFLOW_HINT)
    _expect_empty_rows_are_zero(name, fn)

    scores, where = (
        torch.randn(2, 5, 6, generator=generator, dtype=torch.float64),
        f"{name} (mask=None)",
    )
    hint = "`mask` defaults to None: then it is a plain softmax over the last dim."
    unmasked = call(where, fn, scores, hint=hint)
    expect_close(unmasked, scores.softmax(-1), where, hint, atol=1e-10, rtol=1e-8)
    passed(name)
