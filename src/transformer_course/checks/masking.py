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
    seeded,
    shape_of,
)

AND_HINT = "a key is allowed only if *every* mask allows it: combine with AND (`&`), not OR (`|`)."
BROADCAST_HINT = "let the masks broadcast: (q_pos, k_pos) & (batch, 1, 1, k_pos) is (batch, 1, "
BROADCAST_HINT += "q_pos, k_pos). `&` broadcasts for you; don't stack, reshape or slice them."
NONE_HINT = "`None` means no restriction: skip it; with no mask left, return None."
NON_BOOL_HINT = "a 0/1 float or int mask could mean either convention: refuse it with a "
NON_BOOL_HINT += "ValueError, e.g. `validate.bool_mask(f'masks[{index}]', mask)`."


def _expect_bool_mask(actual: object, expected: torch.Tensor, name: str, hint: str) -> None:
    """A bool tensor of the expected shape."""
    dtype = getattr(actual, "dtype", describe(actual))
    bools = "masks are boolean with True = may attend (e.g. `torch.ones(..., dtype=torch.bool)`)."
    expect(dtype == torch.bool, name, f"expected a bool tensor, got {dtype}.", bools)
    problem = f"expected shape {tuple(expected.shape)}, got {shape_of(actual)}."
    expect(shape_of(actual) == expected.shape, name, problem, hint)


def check_causal_mask(fn: Callable[..., torch.Tensor]) -> None:
    """`causal_mask(q_len, k_len=None, device=None)`: aligned to the last key."""
    name = "causal_mask"
    for args in ((4,), (6, 6), (3, 7), (1, 5), (1,)):
        actual, expected = call(name, fn, *args), masking.causal_mask(*args)
        where, (q_len, k_len) = f"{name}{args}".replace(",)", ")"), expected.shape
        hint = "build the mask from the lengths you are given, not from a maximum length."
        _expect_bool_mask(actual, expected, where, hint)
        ones, side = torch.ones(q_len, k_len, dtype=torch.bool), max(q_len, k_len)
        mistakes = {
            "the diagonal is excluded: a token may attend to itself, keep the diagonal "
            "(`tril(diagonal=0)` when q_len == k_len).": ones.tril(k_len - q_len - 1),
            "each query also sees the next key, the one it must predict: the diagonal is the last "
            "allowed key.": ones.tril(k_len - q_len + 1),
            "the mask is inverted: True means *may attend*, to itself and earlier keys.": ~expected,
            f"with k_len={k_len} > q_len={q_len} the queries are the *last* q_len positions: don't "
            "slice the top-left corner of a square mask built for the maximum length; query i "
            "sees keys j <= i + (k_len - q_len).": ones.new_ones(side, side).tril()[:q_len, :k_len],
        }
        hint = "query i may attend to key j exactly when j <= i + (k_len - q_len)."
        expect_close(actual, expected, where, hint, mistakes=mistakes)
    meta, where = call(name, fn, 3, 5, device="meta"), f"{name}(3, 5, device='meta')"
    on, hint = getattr(meta, "device", describe(meta)), "create the tensor with device=device."
    expect(getattr(on, "type", "") == "meta", where, f"the mask is on {on}, not on 'meta'.", hint)
    for args, why in (((0,), "an empty mask"), ((4, 2), "queries that see no key at all")):
        where = f"{name}{args}".replace(",)", ")")
        hint = f"this gives {why} without a word: refuse it with a ValueError. {LENGTHS_HINT}"
        expect_raises(where, hint, fn, *args, errors=(ValueError,))
    passed(name)


LENGTHS_HINT = "q_len must be a positive int and k_len at least q_len: validate.positive_int("
LENGTHS_HINT += '"q_len", q_len) and validate.at_least("k_len", k_len, "q_len", q_len) refuse '
LENGTHS_HINT += "the others."


def check_padding_mask(fn: Callable[..., torch.Tensor]) -> None:
    """`padding_mask(tokens, pad_id)`: (batch, 1, 1, k_pos), False at padding keys."""
    name = "padding_mask"
    for tokens, pad_id in (
        (torch.tensor([[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 9]]), 0),
        (torch.tensor([[3, 3, 50257, 50257]]), 50257),
    ):
        actual, expected = call(name, fn, tokens, pad_id), masking.padding_mask(tokens, pad_id)
        hint = "padding is a property of keys: (batch, 1, 1, k_pos) hides them from every query."
        expect(shape_of(actual) != expected.mT.shape, name, "it masks *queries*, not keys.", hint)
        _expect_bool_mask(actual, expected, name, "add head and query axes: [:, None, None, :].")
        inverted = "the mask is inverted: real tokens are True, padding False (tokens != pad_id)."
        hint = "compare tokens with pad_id, then add the head and query axes: [:, None, None, :]."
        expect_close(actual, expected, name, hint, mistakes={inverted: ~expected})
    passed(name)


def check_combine_masks(fn: Callable[..., torch.Tensor | None]) -> None:
    """`combine_masks(*masks)`: AND, broadcast, None skipped, non-bool refused."""
    name = "combine_masks"
    causal = masking.causal_mask(5)
    padding = masking.padding_mask(torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1] * 5]), 0)
    random = torch.rand(3, 1, 5, 5, generator=seeded(0)) < 0.5
    for label, masks in [
        ("causal_mask(5), padding_mask(tokens, 0)", (causal, padding)),
        ("padding_mask(tokens, 0), causal_mask(5)", (padding, causal)),
        ("a causal, None and two more masks", (causal, None, padding, random)),
        ("None, then a padding mask", (None, padding)),
        ("a single mask", (random,)),
        ("None, None", (None, None)),
        ("", ()),
    ]:
        where, hint = f"{name}({label})", NONE_HINT if None in masks else BROADCAST_HINT
        actual, expected = call(where, fn, *masks, hint=hint), masking.combine_masks(*masks)
        if expected is None:
            expect(actual is None, where, f"expected None, got {describe(actual)}.", NONE_HINT)
            continue
        expect(isinstance(actual, torch.Tensor), where, f"got {describe(actual)}.", hint)
        _expect_bool_mask(actual, expected, where, BROADCAST_HINT)
        either = reduce(torch.logical_or, [mask for mask in masks if mask is not None])
        mistakes = {
            "a key allowed by any one mask is allowed: that is OR. " + AND_HINT: either,
            "the result is inverted. " + CONVENTION_HINT: ~expected,
        }
        expect_close(actual, expected, where, AND_HINT, mistakes=mistakes)
    first, second = (torch.rand(2, 1, 4, 4, generator=seeded(s)) < 0.5 for s in (1, 2))
    before, where = (first.clone(), second.clone()), f"{name}(two masks of one shape)"
    call(where, fn, first, second, hint=AND_HINT)
    same = torch.equal(first, before[0]) and torch.equal(second, before[1])
    hint = "`combined &= mask` writes into the caller's mask: use `combined = combined & mask`."
    expect(same, where, "an input mask changed: the caller's mask was modified in place.", hint)
    for label, masks in (("an int", (causal, padding.long())), ("a float", (causal.float(),))):
        where, refused = f"{name}({label} 0/1 mask)", (ValueError, TypeError)
        expect_raises(where, NON_BOOL_HINT, fn, *masks, errors=refused)
    hint = "masks whose shapes don't broadcast can't be combined: raise an error, don't slice."
    square = torch.ones(4, 4, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)
    expect_raises(f"{name}(masks of shapes (4, 4) and (3, 3))", hint, fn, *square)
    passed(name)


HALF_HINT = "half-precision scores: compute the softmax in float32 (`upcast(scores)`, given), "
HALF_HINT += "then return the pattern in the scores' own dtype (`.to(scores.dtype)`)."


def _expect_weights(where: str, fn: Callable, scores, mask, finite_hint: str, crash: str = ""):
    """The learner's weights: a tensor of the scores' shape, the convention kept, finite."""
    actual = call(where, fn, scores, mask, hint=crash)
    shaped = isinstance(actual, torch.Tensor) and actual.shape == scores.shape
    expect(shaped, where, f"expected {describe(scores)}, got {describe(actual)}.")
    expect_mask_not_inverted(where, actual, mask)
    expect(bool(actual.isfinite().all()), where, "the result contains NaN or inf.", finite_hint)
    return actual.detach()


def check_masked_softmax(fn: Callable[..., torch.Tensor]) -> None:
    """`masked_softmax(scores, mask=None)`: no overflow, empty rows zero, any dtype."""
    name, generator = "masked_softmax", seeded(0)
    for dtype, scale in ((torch.float64, 1.0), (torch.float32, 60.0), (torch.float64, 400.0)):
        scores = torch.randn(2, 3, 5, 6, generator=generator, dtype=torch.float64) * scale
        scores, mask = scores.to(dtype), torch.rand(2, 1, 5, 6, generator=generator) < 0.6
        mask[..., 0] = True
        where = f"{name} ({str(dtype)[6:]} scores up to {scores.abs().max().item():.0f})"
        actual = _expect_weights(where, fn, scores, mask, OVERFLOW_HINT)
        sums = actual.sum(-1)
        hint = "take the softmax over keys, the last dim (`dim=-1`), not over queries."
        problem = "the weights of a query (a row) do not sum to one."
        expect(torch.allclose(sums, torch.ones_like(sums), atol=1e-5), where, problem, hint)
        hint = OVERFLOW_HINT if scale > 1 else "softmax over the last dim of the filled scores."
        tolerance = {"atol": 1e-10, "rtol": 1e-8} if scale == 1 else {"atol": 1e-5, "rtol": 1e-4}
        expect_close(actual, masking.masked_softmax(scores, mask), where, hint, **tolerance)
    empty = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    nan = "softmax over a row that is all -inf is 0/0 = NaN. Fill with a large *finite* "
    nan += "negative number, `torch.finfo(scores.dtype).min`, and zero the empty rows."
    fp16 = "-1e9 does not fit in fp16 (it ends at -65504): fill with torch.finfo(dtype).min."
    hint = "with a finite fill an empty row comes out uniform: set the weights of forbidden keys "
    hint += "to 0 after the softmax (`masked_fill(~mask, 0)`)."
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        scores = torch.randn(3, 4, generator=seeded(3)).to(dtype)
        where = f"{name} ({dtype}, a row with no allowed key)"
        row = _expect_weights(where, fn, scores, empty, nan, fp16 * (dtype != torch.float32))[1]
        expect(not row.any(), where, f"expected an all-zero pattern row, got {row.tolist()}.", hint)
    for dtype in (torch.float16, torch.bfloat16):  # in float32 inside, the scores' dtype out
        scores = (torch.randn(2, 5, 6, generator=generator) * 30).to(dtype)
        mask, where = torch.rand(2, 5, 6, generator=generator) < 0.7, f"{name} ({dtype} scores)"
        actual = _expect_weights(where, fn, scores, mask, OVERFLOW_HINT, fp16)
        problem = f"expected a {str(dtype)[6:]} pattern (the scores' dtype), got {actual.dtype}."
        expect(actual.dtype == dtype, where, problem, HALF_HINT)
        expected = masking.masked_softmax(scores, mask)
        expect_close(actual, expected, where, HALF_HINT, atol=1e-2, rtol=1e-2)
    scores = torch.randn(2, 5, 6, generator=generator, dtype=torch.float64)
    where, hint = f"{name}(mask=None)", "`mask` defaults to None: plain softmax over the last dim."
    unmasked = call(where, fn, scores, hint=hint)
    expect_close(unmasked, scores.softmax(-1), where, hint, atol=1e-10, rtol=1e-8)
    passed(name)
