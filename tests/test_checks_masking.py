"""The chapter 3 checkers accept the reference, reject blanks with their hint, and name each classic bug."""

import pytest
import torch

from transformer_course.checks import CheckFailure
from transformer_course.checks.masking import check_causal_mask, check_masked_softmax, check_padding_mask
from transformer_course.masking import causal_mask, masked_softmax, padding_mask


def test_reference_passes(capsys):
    check_causal_mask(causal_mask)
    check_padding_mask(padding_mask)
    check_masked_softmax(masked_softmax)
    out = capsys.readouterr().out
    for name in ("causal_mask", "padding_mask", "masked_softmax"):
        assert f"✓ {name} passes every check" in out


def _blank(*args, **kwargs):
    raise NotImplementedError("start from torch.ones(..., dtype=torch.bool)")


@pytest.mark.parametrize("checker", [check_causal_mask, check_padding_mask, check_masked_softmax])
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
    [(_causal(-1), "diagonal"), (_causal(+1), "diagonal"), (_causal(max_len=32), "maximum length"),
     (_causal_max_shape, "maximum length"), (_causal(invert=True), "inverted"),
     (_causal(dtype=torch.float32), "bool")],
)
def test_causal_mask_bugs(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_causal_mask(fn)
    assert word in str(info.value)


@pytest.mark.parametrize(
    ("fn", "word"),
    [(lambda tokens, pad_id: (tokens != pad_id)[:, None, :, None], "queries"),
     (lambda tokens, pad_id: (tokens == pad_id)[:, None, None, :], "inverted"),
     (lambda tokens, pad_id: (tokens != pad_id), "shape"),
     (lambda tokens, pad_id: (tokens != pad_id)[:, None, None, :].long(), "bool")],
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
    return scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-2).masked_fill(~mask, 0.0)


def mask_after_softmax(scores, mask):
    return scores.softmax(-1).masked_fill(~mask, 0.0)


@pytest.mark.parametrize(
    ("fn", "word"),
    [(minus_inf, "NaN"), (minus_1e9, "fp16"), (no_zeroing, "zero"),
     (query_dim, "dim=-1"), (mask_after_softmax, "sum to one")],
)
def test_masked_softmax_bugs(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_masked_softmax(fn)
    assert word in str(info.value)
