"""Checkers for the chapter 3 workbook: causal mask, padding mask, safe masked softmax."""

from __future__ import annotations

from collections.abc import Callable

import torch

from transformer_course import masking
from transformer_course.checks import CheckFailure, call, expect, expect_close, passed

__all__ = ["check_causal_mask", "check_padding_mask", "check_masked_softmax"]


def _expect_bool_mask(actual: object, expected: torch.Tensor, name: str) -> None:
    expect(isinstance(actual, torch.Tensor), name, f"expected a torch.Tensor, got {type(actual).__name__}.")
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


def check_causal_mask(fn: Callable[..., torch.Tensor]) -> None:
    """`causal_mask(q_len, k_len=None)`: lower triangle, aligned to the last key when k_len > q_len."""
    name = "causal_mask"
    for q_len, k_len in ((4, None), (6, 6), (3, 7), (1, 5), (1, None)):
        args = (q_len,) if k_len is None else (q_len, k_len)
        actual = call(name, fn, *args)
        expected = masking.causal_mask(*args)
        where = f"{name}({', '.join(map(str, args))})"
        _expect_bool_mask(actual, expected, where)
        if torch.equal(actual, expected):
            continue
        k_len = k_len or q_len
        ones = torch.ones(q_len, k_len, dtype=torch.bool)
        expect(not torch.equal(actual, ones.tril(k_len - q_len - 1)), where, "the diagonal is excluded.",
               "a token may attend to itself: keep the diagonal (`tril(diagonal=0)` when q_len == k_len).")
        expect(not torch.equal(actual, ones.tril(k_len - q_len + 1)), where, "each query also sees the next key.",
               "that lets a token peek at the one it must predict: the diagonal is the last allowed key.")
        expect(not torch.equal(actual, ~expected), where, "the mask is inverted.",
               "True means *may attend*: a query may look at itself and earlier keys.")
        top_left = torch.ones(max(q_len, k_len), max(q_len, k_len), dtype=torch.bool).tril()[:q_len, :k_len]
        expect(not torch.equal(actual, top_left), where,
               f"with k_len={k_len} > q_len={q_len} the queries are the *last* q_len positions, so the last query must see every key.",
               "don't build a square mask for the maximum length and slice its top-left corner: "
               "query i sees keys j <= i + (k_len - q_len) (`tril(diagonal=k_len - q_len)`).")
        expect(False, where, f"expected\n{expected.int()}\ngot\n{actual.int()}",
               "query i may attend to key j exactly when j <= i + (k_len - q_len).")
    meta = call(name, fn, 3, 5, device="meta")
    expect(isinstance(meta, torch.Tensor) and meta.device.type == "meta", f"{name}(3, 5, device='meta')",
           f"the mask is on {getattr(meta, 'device', type(meta).__name__)}, not on the device it was given.",
           "create the tensor with device=device, so the mask lives where the scores live.")
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
                "Hint: padding is a property of keys: shape (batch, 1, 1, k_pos) so that every query "
                "(and every head) ignores the padding keys."
            )
        _expect_bool_mask(actual, expected, name)
        expect(not torch.equal(actual, ~expected), name, "the mask is inverted.",
               "True means may attend: real tokens are True, padding is False (`tokens != pad_id`).")
        expect(torch.equal(actual, expected), name, f"expected\n{expected.int()}\ngot\n{actual.int()}",
               "compare tokens with pad_id, then add the head and query axes with `[:, None, None, :]`.")
    passed(name)


def check_masked_softmax(fn: Callable[..., torch.Tensor]) -> None:
    """`masked_softmax(scores, mask)`: softmax over allowed keys; zeros (never NaN) for empty rows."""
    name = "masked_softmax"
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(2, 1, 5, 6, generator=g) < 0.6
    mask[..., 0] = True
    expected = masking.masked_softmax(scores, mask)
    actual = call(name, fn, scores, mask)
    expect(isinstance(actual, torch.Tensor), name, f"expected a torch.Tensor, got {type(actual).__name__}.")
    if tuple(actual.shape) == tuple(expected.shape) and not torch.isnan(actual).any():
        expect(not torch.allclose(actual.detach(), masking.masked_softmax(scores, ~mask), atol=1e-8), name,
               "the mask is inverted.", "True means *may attend*: forbid the keys where the mask is False.")
        row_sums = actual.detach().sum(-1)
        expect(torch.allclose(row_sums, torch.ones_like(row_sums), atol=1e-6), name,
               "the weights of a query (a row) do not sum to one.",
               "take the softmax over keys, the last dim (`dim=-1`), not over queries (`dim=-2`).")
        leaked = actual.detach().masked_select(~mask.expand_as(actual)).abs().max()
        expect(leaked.item() < 1e-6, name, f"forbidden keys get weight (up to {leaked.item():.3g}).",
               "fill forbidden scores with a large negative number *before* the softmax.")
    expect_close(actual, expected, name, "softmax over the last dim of the filled scores.", atol=1e-10, rtol=1e-8)

    # Rows with no allowed key: zeros, finite gradients, in every dtype.
    empty = torch.tensor([[True, False, True, False], [False, False, False, False], [True, True, True, True]])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        scores = torch.randn(3, 4, generator=g).to(dtype).requires_grad_()
        where = f"{name} ({dtype}, a row with no allowed key)"
        try:
            actual = call(name, fn, scores, empty)
        except CheckFailure as failure:
            if "overflow" not in str(failure):
                raise
            raise CheckFailure(
                f"`{where}`: {failure}\nHint: a constant such as -1e9 does not fit in fp16 (its range ends "
                "at -65504); fill with `torch.finfo(scores.dtype).min`."
            ) from None
        expect(isinstance(actual, torch.Tensor), where, f"expected a torch.Tensor, got {type(actual).__name__}.")
        expect(not torch.isnan(actual).any().item(), where, "the result contains NaN.",
               "softmax over a row that is all -inf is 0/0 = NaN. Fill with a large *finite* negative number, "
               "`torch.finfo(scores.dtype).min` (-1e9 overflows to -inf in fp16), and zero the empty rows.")
        expect(torch.equal(actual[1].detach(), torch.zeros(4, dtype=dtype)), where,
               f"expected an all-zero pattern row, got {actual[1].detach().tolist()}.",
               "with a finite fill an empty row comes out uniform; set the weights of forbidden keys to 0 "
               "after the softmax (`masked_fill(~mask, 0)`).")
        actual.float().pow(2).sum().backward()
        expect(scores.grad is not None and torch.isfinite(scores.grad).all().item(), where,
               "the gradient contains NaN or inf.", "avoid -inf anywhere in the computation; use a finite fill.")
        expect_close(actual.detach().float(), masking.masked_softmax(scores.detach(), empty).float(), where,
                     atol=1e-2, rtol=1e-2)

    scores = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    unmasked = call(name, fn, scores)
    expect_close(unmasked, scores.softmax(-1), f"{name} (mask=None)",
                 "without a mask it is a plain softmax over the last dim.", atol=1e-10, rtol=1e-8)
    passed(name)
