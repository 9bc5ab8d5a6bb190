"""Checkers for the chapter 3 workbook: causal mask, padding mask, combined masks, safe masked
softmax. Chapter 2's attention checkers share `expect_mask_not_inverted` (a pattern that follows
the opposite mask convention) and `call_with_hint` (a crash explained by a hint)."""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from typing import Any

import torch

from transformer_course import masking
from transformer_course.checks import CheckFailure, call, expect, expect_close, passed

__all__ = [
    "check_causal_mask",
    "check_padding_mask",
    "check_combine_masks",
    "check_masked_softmax",
    "call_with_hint",
    "expect_mask_not_inverted",
]

CONVENTION_HINT = (
    "True means *may attend* (PyTorch's convention): keep the scores where the mask is True and "
    "fill the ones where it is False (`~mask`)."
)
OVERFLOW_HINT = (
    "exp overflows for large scores (above about 88 in float32, 709 in float64): subtract each "
    "row's maximum before exp (a constant shift leaves the softmax unchanged), as "
    "`torch.softmax` does."
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
    "`None` means no restriction: skip it. With no mask left (all None, or none given) return None."
)
NON_BOOL_HINT = (
    "a 0/1 float or int mask could mean either convention: refuse it with a ValueError, e.g. "
    "`validate.bool_mask(mask, f'masks[{index}]')`."
)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"a tensor of dtype {dtype} and shape {tuple(value.shape)}"
    return repr(value) if value is None else type(value).__name__


def call_with_hint(name: str, hint: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call`, adding `hint` when the learner's code crashes (not when it is a blank)."""
    try:
        return call(name, fn, *args, **kwargs)
    except CheckFailure as failure:
        if failure.__cause__ is None:
            raise
        raise CheckFailure(f"{failure}\nHint: {hint}") from failure.__cause__


def expect_mask_not_inverted(name: str, pattern: Any, mask: torch.Tensor) -> None:
    """Fail with the mask convention's hint if `pattern` (..., q_pos, k_pos) gives its weight to
    the keys `mask` forbids and none to the keys it allows, NaN rows counting as zero."""
    if not isinstance(pattern, torch.Tensor) or not pattern.is_floating_point():
        return
    try:
        allowed = mask.expand_as(pattern)
    except RuntimeError:
        return
    weights = pattern.detach().double().nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()
    on_allowed, on_forbidden = weights[allowed].sum().item(), weights[~allowed].sum().item()
    expect(
        not (on_allowed < 1e-6 and on_forbidden > 1e-3),
        name,
        "the mask is inverted: the forbidden keys get the weight and the allowed ones get none.",
        CONVENTION_HINT,
    )


def _expect_bool_mask(actual: object, expected: torch.Tensor, name: str) -> None:
    expect(
        isinstance(actual, torch.Tensor),
        name,
        f"expected a torch.Tensor, got {type(actual).__name__}.",
    )
    expect(
        actual.dtype == torch.bool,
        name,
        f"expected a bool tensor, got dtype {actual.dtype}.",
        "masks are boolean with True = may attend (e.g. `torch.ones(..., dtype=torch.bool)`).",
    )
    expect(
        tuple(actual.shape) == tuple(expected.shape),
        name,
        f"expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}.",
        "build the mask from the actual lengths you are given, not from a maximum length.",
    )


def _explain_causal_mistake(where: str, actual: torch.Tensor, q_len: int, k_len: int) -> None:
    """Name the classic causal-mask bug that `actual` matches, or show both masks."""
    expected = masking.causal_mask(q_len, k_len)
    ones = torch.ones(q_len, k_len, dtype=torch.bool)
    expect(
        not torch.equal(actual, ones.tril(k_len - q_len - 1)),
        where,
        "the diagonal is excluded.",
        "a token may attend to itself: keep the diagonal (`tril(diagonal=0)` when q_len == k_len).",
    )
    expect(
        not torch.equal(actual, ones.tril(k_len - q_len + 1)),
        where,
        "each query also sees the next key.",
        "that lets a token peek at the one it must predict: the diagonal is the last allowed key.",
    )
    expect(
        not torch.equal(actual, ~expected),
        where,
        "the mask is inverted.",
        "True means *may attend*: a query may look at itself and earlier keys.",
    )
    square = torch.ones(max(q_len, k_len), max(q_len, k_len), dtype=torch.bool).tril()
    expect(
        not torch.equal(actual, square[:q_len, :k_len]),
        where,
        f"with k_len={k_len} > q_len={q_len} the queries are the *last* q_len positions, so "
        "the last query must see every key.",
        "don't build a square mask for the maximum length and slice its top-left corner: "
        "query i sees keys j <= i + (k_len - q_len) (`tril(diagonal=k_len - q_len)`).",
    )
    expect(
        False,
        where,
        f"expected\n{expected.int()}\ngot\n{actual.int()}",
        "query i may attend to key j exactly when j <= i + (k_len - q_len).",
    )


def check_causal_mask(fn: Callable[..., torch.Tensor]) -> None:
    """`causal_mask(q_len, k_len=None)`: lower triangle, aligned to the last key when
    k_len > q_len."""
    name = "causal_mask"
    for q_len, k_len in ((4, None), (6, 6), (3, 7), (1, 5), (1, None)):
        args = (q_len,) if k_len is None else (q_len, k_len)
        actual = call(name, fn, *args)
        expected = masking.causal_mask(*args)
        where = f"{name}({', '.join(map(str, args))})"
        _expect_bool_mask(actual, expected, where)
        if not torch.equal(actual, expected):
            _explain_causal_mistake(where, actual, q_len, k_len or q_len)
    meta = call(name, fn, 3, 5, device="meta")
    expect(
        isinstance(meta, torch.Tensor) and meta.device.type == "meta",
        f"{name}(3, 5, device='meta')",
        f"the mask is on {getattr(meta, 'device', type(meta).__name__)}, not on the device it "
        "was given.",
        "create the tensor with device=device, so the mask lives where the scores live.",
    )
    passed(name)


def check_padding_mask(fn: Callable[..., torch.Tensor]) -> None:
    """`padding_mask(tokens, pad_id)`: (batch, 1, 1, k_pos), False at padding keys."""
    name = "padding_mask"
    for tokens, pad_id in (
        (torch.tensor([[5, 6, 7, 0, 0], [8, 0, 0, 0, 0], [1, 2, 3, 4, 9]]), 0),
        (torch.tensor([[3, 3, 50257, 50257]]), 50257),
    ):
        actual = call(name, fn, tokens, pad_id)
        expected = masking.padding_mask(tokens, pad_id)
        batch, k_len = tokens.shape
        if isinstance(actual, torch.Tensor) and tuple(actual.shape) == (batch, 1, k_len, 1):
            raise CheckFailure(
                f"`{name}`: got shape {tuple(actual.shape)}, which masks *queries*, not keys.\n"
                "Hint: padding is a property of keys: shape (batch, 1, 1, k_pos) so that every "
                "query (and every head) ignores the padding keys."
            )
        _expect_bool_mask(actual, expected, name)
        expect(
            not torch.equal(actual, ~expected),
            name,
            "the mask is inverted.",
            "True means may attend: real tokens are True, padding is False (`tokens != pad_id`).",
        )
        expect(
            torch.equal(actual, expected),
            name,
            f"expected\n{expected.int()}\ngot\n{actual.int()}",
            "compare tokens with pad_id, then add the head and query axes with "
            "`[:, None, None, :]`.",
        )
    passed(name)


def _combine_cases() -> list[tuple[str, tuple[torch.Tensor | None, ...]]]:
    """Labelled argument tuples: masks of different shapes and kinds, in different orders."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    causal, padding = masking.causal_mask(5), masking.padding_mask(tokens, 0)
    random = torch.rand(3, 1, 5, 5, generator=g) < 0.5
    return [
        ("causal_mask(5), padding_mask(tokens, 0)", (causal, padding)),
        ("padding_mask(tokens, 0), causal_mask(5)", (padding, causal)),
        ("a causal, None and two more masks", (causal, None, padding, random)),
        ("None, then a padding mask", (None, padding)),
        ("a single mask", (random,)),
    ]


def _expect_combined(where: str, actual: Any, masks: tuple[torch.Tensor | None, ...]) -> None:
    expected = masking.combine_masks(*masks)
    expect(
        isinstance(actual, torch.Tensor),
        where,
        f"expected {_describe(expected)}, got {_describe(actual)}.",
        NONE_HINT if None in masks else BROADCAST_HINT,
    )
    expect(
        actual.dtype == torch.bool,
        where,
        f"expected a bool tensor, got dtype {actual.dtype}.",
        "`&` (or `torch.logical_and`) of two bool masks is a bool mask: no conversion needed.",
    )
    expect(
        tuple(actual.shape) == tuple(expected.shape),
        where,
        f"expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}.",
        BROADCAST_HINT,
    )
    present = [m for m in masks if m is not None]
    if len(present) > 1:
        either = reduce(torch.logical_or, present)
        expect(
            not torch.equal(actual, either),
            where,
            "a key allowed by any one mask is allowed: that is OR.",
            AND_HINT,
        )
    expect(not torch.equal(actual, ~expected), where, "the result is inverted.", CONVENTION_HINT)
    expect(
        torch.equal(actual, expected),
        where,
        f"{int((actual != expected).sum())} of {expected.numel()} entries differ.",
        AND_HINT,
    )


def _expect_refused(
    name: str,
    fn: Callable[..., Any],
    masks: tuple[Any, ...],
    hint: str,
    errors: tuple[type[Exception], ...] = (ValueError, TypeError),
) -> None:
    """The learner's function must raise one of `errors` for `masks`."""
    try:
        result = fn(*masks)
    except errors:
        return
    except Exception as exc:
        raise CheckFailure(f"`{name}` raised {type(exc).__name__}: {exc}\nHint: {hint}") from exc
    raise CheckFailure(f"`{name}`: accepted, returning {_describe(result)}.\nHint: {hint}")


def check_combine_masks(fn: Callable[..., torch.Tensor | None]) -> None:
    """`combine_masks(*masks)`: AND of bool masks with broadcasting, None skipped, non-bool
    masks refused, the inputs left as they were."""
    name = "combine_masks"
    for label, masks in _combine_cases():
        where = f"{name}({label})"
        hint = NONE_HINT if None in masks else BROADCAST_HINT
        _expect_combined(where, call_with_hint(where, hint, fn, *masks), masks)

    for masks in ((None, None), ()):
        where = f"{name}({', '.join(map(repr, masks))})"
        actual = call_with_hint(where, NONE_HINT, fn, *masks)
        expect(actual is None, where, f"expected None, got {_describe(actual)}.", NONE_HINT)

    g = torch.Generator().manual_seed(1)
    first, second = (torch.rand(2, 1, 4, 4, generator=g) < 0.5 for _ in range(2))
    before = first.clone(), second.clone()
    call_with_hint(f"{name}(two masks of one shape)", AND_HINT, fn, first, second)
    expect(
        torch.equal(first, before[0]) and torch.equal(second, before[1]),
        f"{name}(two masks of one shape)",
        "an input mask changed: the caller's mask was modified in place.",
        "`combined &= mask` writes into the caller's first mask: use `combined = combined & mask`.",
    )

    causal, padding = masking.causal_mask(5), masking.padding_mask(torch.ones(2, 5).long(), 0)
    _expect_refused(
        f"{name}(a causal mask, an int 0/1 mask)", fn, (causal, padding.long()), NON_BOOL_HINT
    )
    _expect_refused(f"{name}(a float 0/1 mask)", fn, (causal.float(),), NON_BOOL_HINT)
    _expect_refused(
        f"{name}(masks of shapes (4, 4) and (3, 3))",
        fn,
        (torch.ones(4, 4, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool)),
        "masks whose shapes don't broadcast can't be combined: raise an error instead of "
        "slicing or expanding one to fit.",
        errors=(Exception,),
    )
    passed(name)


def _expect_stable_on_large_scores(name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Scores of several hundred: a softmax that exponentiates them directly overflows."""
    g = torch.Generator().manual_seed(2)
    for dtype, scale in ((torch.float32, 60.0), (torch.float64, 400.0)):
        scores = (torch.randn(2, 5, 6, generator=g, dtype=torch.float64) * scale).to(dtype)
        mask = torch.rand(1, 5, 6, generator=g) < 0.7
        mask[..., 0] = True
        used = str(dtype).replace("torch.", "")
        where = f"{name} ({used} scores up to {scores.abs().max().item():.0f})"
        actual = call(name, fn, scores, mask)
        expected = masking.masked_softmax(scores, mask)
        finite = isinstance(actual, torch.Tensor) and bool(torch.isfinite(actual).all())
        expect(finite, where, "the result contains NaN or inf.", OVERFLOW_HINT)
        expect_close(actual, expected, where, OVERFLOW_HINT, atol=1e-5, rtol=1e-4)


def _expect_empty_rows_are_zero(name: str, fn: Callable[..., torch.Tensor]) -> None:
    """Rows with no allowed key: zeros, finite gradients, in every dtype."""
    g = torch.Generator().manual_seed(3)
    empty = torch.tensor(
        [[True, False, True, False], [False, False, False, False], [True, True, True, True]]
    )
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        scores = torch.randn(3, 4, generator=g).to(dtype).requires_grad_()
        where = f"{name} ({dtype}, a row with no allowed key)"
        try:
            actual = call(name, fn, scores, empty)
        except CheckFailure as failure:
            if "overflow" not in str(failure):
                raise
            raise CheckFailure(
                f"`{where}`: {failure}\nHint: a constant such as -1e9 does not fit in fp16 (its "
                "range ends at -65504); fill with `torch.finfo(scores.dtype).min`."
            ) from None
        expect(
            isinstance(actual, torch.Tensor),
            where,
            f"expected a torch.Tensor, got {type(actual).__name__}.",
        )
        expect_mask_not_inverted(where, actual, empty)
        expect(
            not torch.isnan(actual).any().item(),
            where,
            "the result contains NaN.",
            "softmax over a row that is all -inf is 0/0 = NaN. Fill with a large *finite* "
            "negative number, `torch.finfo(scores.dtype).min` (-1e9 overflows to -inf in fp16), "
            "and zero the empty rows.",
        )
        expect(
            torch.equal(actual[1].detach(), torch.zeros(4, dtype=dtype)),
            where,
            f"expected an all-zero pattern row, got {actual[1].detach().tolist()}.",
            "with a finite fill an empty row comes out uniform; set the weights of forbidden keys "
            "to 0 after the softmax (`masked_fill(~mask, 0)`).",
        )
        actual.float().pow(2).sum().backward()
        expect(
            scores.grad is not None and torch.isfinite(scores.grad).all().item(),
            where,
            "the gradient contains NaN or inf.",
            "avoid -inf anywhere in the computation; use a finite fill.",
        )
        reference = masking.masked_softmax(scores.detach(), empty).float()
        expect_close(actual.detach().float(), reference, where, atol=1e-2, rtol=1e-2)


def check_masked_softmax(fn: Callable[..., torch.Tensor]) -> None:
    """`masked_softmax(scores, mask)`: softmax over allowed keys; zeros (never NaN) for empty
    rows; no overflow for large scores; a plain softmax when `mask` is None."""
    name = "masked_softmax"
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 6, generator=g) < 0.6
    mask[..., 0] = True
    expected = masking.masked_softmax(scores, mask)
    actual = call(name, fn, scores, mask)
    expect(
        isinstance(actual, torch.Tensor),
        name,
        f"expected a torch.Tensor, got {type(actual).__name__}.",
    )
    expect_mask_not_inverted(name, actual, mask)
    if tuple(actual.shape) == tuple(expected.shape) and not torch.isnan(actual).any():
        row_sums = actual.detach().sum(-1)
        expect(
            torch.allclose(row_sums, torch.ones_like(row_sums), atol=1e-6),
            name,
            "the weights of a query (a row) do not sum to one.",
            "take the softmax over keys, the last dim (`dim=-1`), not over queries (`dim=-2`).",
        )
        leaked = actual.detach().masked_select(~mask.expand_as(actual)).abs().max()
        expect(
            leaked.item() < 1e-6,
            name,
            f"forbidden keys get weight (up to {leaked.item():.3g}).",
            "fill forbidden scores with a large negative number *before* the softmax.",
        )
    expect_close(
        actual,
        expected,
        name,
        "softmax over the last dim of the filled scores.",
        atol=1e-10,
        rtol=1e-8,
    )
    _expect_stable_on_large_scores(name, fn)
    _expect_empty_rows_are_zero(name, fn)

    scores = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    where = f"{name} (mask=None)"
    unmasked = call_with_hint(
        where, "`mask` defaults to None: then it is a plain softmax.", fn, scores
    )
    expect_close(
        unmasked,
        scores.softmax(-1),
        where,
        "without a mask it is a plain softmax over the last dim.",
        atol=1e-10,
        rtol=1e-8,
    )
    passed(name)
