"""The chapter 3 checkers accept the reference and valid alternatives, reject blanks with
their hint, and name each classic bug."""

import functools
import operator

import pytest
import torch
import torch.nn.functional as F
from checking import fails

from transformer_course import validate
from transformer_course.checks.harness import CheckFailure
from transformer_course.checks.masking import (
    check_causal_mask,
    check_combine_masks,
    check_masked_softmax,
    check_padding_mask,
)
from transformer_course.masking import causal_mask, combine_masks, masked_softmax, padding_mask

CHECKERS = [check_causal_mask, check_padding_mask, check_combine_masks, check_masked_softmax]


def test_reference_passes(capsys):
    check_causal_mask(causal_mask)
    check_padding_mask(padding_mask)
    check_combine_masks(combine_masks)
    check_masked_softmax(masked_softmax)
    out = capsys.readouterr().out
    for name in ("causal_mask", "padding_mask", "combine_masks", "masked_softmax"):
        assert f"✓ {name} passes every check" in out


def _blank(*args, **kwargs):
    raise NotImplementedError("start from torch.ones(..., dtype=torch.bool)")


@pytest.mark.parametrize("checker", CHECKERS)
def test_blank_fails_with_its_hint(checker):
    with pytest.raises(CheckFailure, match="not implemented yet") as info:
        checker(_blank)
    assert "torch.ones" in str(info.value)


def _causal(diagonal_shift=0, *, max_len=None, dtype=torch.bool, invert=False):
    def causal(q_len, k_len=None, *, device=None):
        k_len = q_len if k_len is None else k_len
        if max_len is not None:  # build once for a maximum length, then slice
            mask = torch.ones(max_len, max_len, dtype=torch.bool).tril()[:q_len, :k_len]
        else:
            mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len + diagonal_shift)
        mask = ~mask if invert else mask
        return mask.to(dtype=dtype, device=device)

    return causal


def _causal_max_shape(q_len, k_len=None, *, device=None):
    return torch.ones(16, 16, dtype=torch.bool, device=device).tril()


@pytest.mark.parametrize(
    ("fn", "word"),
    [
        (_causal(-1), "diagonal"),
        (_causal(+1), "diagonal"),
        (_causal(max_len=32), "maximum length"),
        (_causal_max_shape, "maximum length"),
        (_causal(invert=True), "inverted"),
        (_causal(dtype=torch.float32), "bool"),
    ],
)
def test_causal_mask_bugs(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_causal_mask(fn)
    assert word in str(info.value)


def test_causal_mask_without_its_length_checks_is_caught():
    fails(check_causal_mask, _causal(), "causal_mask(0)", "an empty mask", "ValueError")


def test_causal_mask_that_accepts_fewer_keys_than_queries_is_caught():
    def positive_only(q_len, k_len=None, *, device=None):
        validate.positive_int("q_len", q_len)
        return _causal()(q_len, k_len, device=device)

    fails(check_causal_mask, positive_only, "causal_mask(4, 2)", "no key at all")


def test_causal_mask_with_its_own_length_checks_passes():
    def own_checks(q_len, k_len=None, *, device=None):
        if not isinstance(q_len, int) or q_len < 1 or (k_len is not None and k_len < q_len):
            raise ValueError(f"q_len, k_len: expected 1 <= q_len <= k_len, got {q_len}, {k_len}")
        return _causal()(q_len, k_len, device=device)

    check_causal_mask(own_checks)


def test_a_helper_called_with_its_arguments_swapped_says_so():
    with pytest.raises(TypeError, match=r"name \(a str\) first.*got 4 where the name goes"):
        validate.positive_int(4, "q_len")


@pytest.mark.parametrize(
    ("fn", "word"),
    [
        (lambda tokens, pad_id: (tokens != pad_id)[:, None, :, None], "queries"),
        (lambda tokens, pad_id: (tokens == pad_id)[:, None, None, :], "inverted"),
        (lambda tokens, pad_id: tokens != pad_id, "shape"),
        (lambda tokens, pad_id: (tokens != pad_id)[:, None, None, :].long(), "bool"),
    ],
)
def test_padding_mask_bugs(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_padding_mask(fn)
    assert word in str(info.value)


def minus_inf(scores, mask):
    return scores.masked_fill(~mask, float("-inf")).softmax(-1)


def minus_1e9(scores, mask):
    return scores.masked_fill(~mask, -1e9).softmax(-1).masked_fill(~mask, 0.0)


def no_zeroing(scores, mask):
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1)


def query_dim(scores, mask):
    return (
        scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-2).masked_fill(~mask, 0.0)
    )


def mask_after_softmax(scores, mask):
    return scores.softmax(-1).masked_fill(~mask, 0.0)


@pytest.mark.parametrize(
    ("fn", "word"),
    [
        (minus_inf, "NaN"),
        (minus_1e9, "fp16"),
        (no_zeroing, "zero"),
        (query_dim, "dim=-1"),
        (mask_after_softmax, "sum to one"),
    ],
)
def test_masked_softmax_bugs(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_masked_softmax(fn)
    assert word in str(info.value)


def test_masked_softmax_that_returns_float32_for_half_scores_is_caught():
    def stays_float32(scores, mask=None):
        return masked_softmax(scores.float() if scores.dtype == torch.float16 else scores, mask)

    fails(check_masked_softmax, stays_float32, "float16 scores", "expected a float16 pattern")


def _manual_softmax(scores):
    shifted = scores - scores.amax(-1, keepdim=True)
    return shifted.exp() / shifted.exp().sum(-1, keepdim=True)


def upcast_and_back(scores, mask=None):
    """Half precision computed in float32, returned in the input's dtype."""
    dtype = scores.dtype
    if dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    if mask is None:
        return F.softmax(scores, dim=-1).to(dtype)
    filled = torch.where(mask, scores, torch.finfo(scores.dtype).min)
    return torch.where(mask, _manual_softmax(filled), 0.0).to(dtype)


@pytest.mark.parametrize(
    "fn",
    [
        upcast_and_back,
        lambda scores, mask=None: masked_softmax(scores, mask),
        lambda scores, mask=None: (
            scores.softmax(-1)
            if mask is None
            else F.softmax(scores.masked_fill(~mask, torch.finfo(scores.dtype).min), dim=-1) * mask
        ),
    ],
    ids=["upcast, torch.where, manual softmax", "reference", "F.softmax times the mask"],
)
def test_masked_softmax_valid_alternatives_pass(fn):
    check_masked_softmax(fn)


def inverted(scores, mask=None):
    return masked_softmax(scores, None if mask is None else ~mask)


def inverted_minus_inf(scores, mask=None):
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


def naive_exp(scores, mask=None):
    filled = scores if mask is None else scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = filled.exp() / filled.exp().sum(-1, keepdim=True)
    return weights if mask is None else weights.masked_fill(~mask, 0.0)


def crashes_without_mask(scores, mask=None):
    return masked_softmax(scores, mask.bool())


@pytest.mark.parametrize(
    ("fn", "word"),
    [
        (inverted, "True means *may attend*"),
        (inverted_minus_inf, "True means *may attend*"),
        (naive_exp, "subtract each row's maximum"),
        (crashes_without_mask, "defaults to None"),
    ],
)
def test_masked_softmax_families(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_masked_softmax(fn)
    assert word in str(info.value), str(info.value)
    assert "dim=-1" not in str(info.value)


# ---- combine_masks ------------------------------------------------------------------------------


def combine_with(op):
    """A correct combine_masks built on `op` (`&`, torch.logical_and, ...)."""

    def combine(*masks):
        present = [
            validate.bool_mask(f"masks[{i}]", m) for i, m in enumerate(masks) if m is not None
        ]
        return functools.reduce(op, present) if present else None

    return combine


@pytest.mark.parametrize(
    "fn",
    [combine_with(operator.and_), combine_with(torch.logical_and), combine_with(operator.mul)],
    ids=["&", "torch.logical_and", "bool product"],
)
def test_combine_masks_valid_alternatives_pass(fn):
    check_combine_masks(fn)


def combine_or(*masks):
    return combine_with(operator.or_)(*masks)


def combine_by_stacking(*masks):
    present = [validate.bool_mask("mask", m) for m in masks if m is not None]
    return torch.stack(present).all(0) if present else None


def combine_expanded_to_first(*masks):
    present = [validate.bool_mask("mask", m) for m in masks if m is not None]
    if not present:
        return None
    combined = present[0].clone()
    for mask in present[1:]:
        combined = combined & mask.expand(*mask.shape[:-2], *combined.shape[-2:])[..., 0, :, :]
    return combined


def combine_without_validation(*masks):
    present = [m for m in masks if m is not None]
    return functools.reduce(operator.and_, present) if present else None


def combine_none_crashes(*masks):
    return functools.reduce(operator.and_, [validate.bool_mask("mask", m) for m in masks])


def combine_none_as_all_true(*masks):
    combined = torch.tensor(True)
    for i, mask in enumerate(masks):
        if mask is not None:
            combined = combined & validate.bool_mask(f"masks[{i}]", mask)
    return combined


def combine_in_place(*masks):
    present = [validate.bool_mask("mask", m) for m in masks if m is not None]
    if not present:
        return None
    combined = present[0]
    for mask in present[1:]:
        if mask.shape == combined.shape:
            combined &= mask
        else:
            combined = combined & mask
    return combined


def combine_asserting_bool(*masks):
    present = [m for m in masks if m is not None]
    assert all(m.dtype == torch.bool for m in present), "masks must be boolean"
    return functools.reduce(operator.and_, present) if present else None


def combine_inverted(*masks):
    combined = combine_masks(*masks)
    return None if combined is None else ~combined


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (combine_or, ["OR", "AND"]),
        (combine_by_stacking, ["broadcast"]),
        (combine_expanded_to_first, ["broadcast"]),
        (combine_without_validation, ["0/1", "ValueError"]),
        (combine_none_crashes, ["None"]),
        (combine_none_as_all_true, ["None"]),
        (combine_in_place, ["in place"]),
        (combine_inverted, ["True means *may attend*"]),
        (combine_asserting_bool, ["raised AssertionError: masks must be boolean", "ValueError"]),
    ],
)
def test_combine_masks_families(fn, words):
    with pytest.raises(CheckFailure) as info:
        check_combine_masks(fn)
    for word in words:
        assert word in str(info.value), str(info.value)
