"""Masks and the safe masked softmax, against PyTorch's own masks and hand-written matrices.

Property tests (hypothesis) check the three promises of chapter 3 on `MultiHeadAttention`:
causality, invariance to extra padding keys, and no NaN when a query has no allowed key.
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right

from transformer_course.attention import MultiHeadAttention, scaled_dot_product_attention
from transformer_course.masking import (
    causal_mask,
    combine_masks,
    fill_masked,
    masked_softmax,
    padding_mask,
)

T, F_ = True, False


def test_causal_mask_square_by_hand():
    expected = torch.tensor([[T, F_, F_], [T, T, F_], [T, T, T]])
    mask = causal_mask(3)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_causal_mask_kv_cache_by_hand():
    # 2 new queries at positions 2 and 3 of a 4-token sequence.
    expected = torch.tensor([[T, T, T, F_], [T, T, T, T]])
    assert torch.equal(causal_mask(2, 4), expected)


@pytest.mark.parametrize(("q_len", "k_len"), [(1, 1), (5, 5), (1, 7), (3, 8), (6, 7)])
def test_causal_mask_matches_torch_lower_right(q_len, k_len):
    reference = causal_lower_right(q_len, k_len)._materialize(torch.device("cpu"))
    assert torch.equal(causal_mask(q_len, k_len), reference)


def test_causal_mask_matches_sdpa_is_causal():
    q, k, v = (torch.randn(2, 3, 6, 4, dtype=torch.float64) for _ in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    actual, _ = scaled_dot_product_attention(q, k, v, causal_mask(6))
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


def test_causal_mask_device():
    assert causal_mask(2, device="cpu").device.type == "cpu"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0,), "q_len: expected a positive int, got 0"),
        ((2.0,), "q_len"),
        ((True,), "q_len"),
        ((4, 3), "k_len: expected k_len >= q_len=4"),
        ((2, -1), "k_len"),
    ],
)
def test_causal_mask_errors(args, message):
    with pytest.raises(ValueError, match=message):
        causal_mask(*args)


def test_padding_mask_by_hand():
    tokens = torch.tensor([[5, 6, 0, 0], [7, 0, 8, 9]])
    expected = torch.tensor([[T, T, F_, F_], [T, F_, T, T]])[:, None, None, :]
    mask = padding_mask(tokens, pad_id=0)
    assert mask.shape == (2, 1, 1, 4) and mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_padding_mask_matches_sdpa_with_key_padding():
    """A padding mask means the same as dropping the padded keys altogether."""
    tokens = torch.tensor([[3, 4, 5, 1, 1]])
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    actual, _ = scaled_dot_product_attention(q, k, v, padding_mask(tokens, pad_id=1))
    expected = F.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3])
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("tokens", "pad_id", "message"),
    [
        (
            torch.tensor([1, 2, 0]),
            0,
            r"tokens: expected an integer tensor of shape \(batch, k_pos\), got \(3,\)",
        ),
        (torch.zeros(2, 3), 0, "tokens: expected an integer dtype, got torch.float32"),
        ([[1, 2]], 0, "tokens: expected an integer tensor"),
        (torch.tensor([[1, 2]]), 0.5, "pad_id: expected an int, got 0.5"),
    ],
)
def test_padding_mask_errors(tokens, pad_id, message):
    with pytest.raises(ValueError, match=message):
        padding_mask(tokens, pad_id)


def test_combine_masks():
    tokens = torch.tensor([[1, 2, 0], [1, 0, 0]])
    combined = combine_masks(causal_mask(3), None, padding_mask(tokens, 0))
    expected = torch.tensor(
        [
            [[T, F_, F_], [T, T, F_], [T, T, F_]],
            [[T, F_, F_], [T, F_, F_], [T, F_, F_]],
        ]
    )[:, None]
    assert torch.equal(combined, expected)
    assert combine_masks(None, None) is None


def test_combine_masks_errors():
    with pytest.raises(ValueError, match=r"masks\[1\]: expected a bool tensor .* got torch.int64"):
        combine_masks(causal_mask(3), torch.ones(3, 3, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"masks\[1\]: shape \(4, 4\) does not broadcast .* \(3, 3\)"
    ):
        combine_masks(causal_mask(3), causal_mask(4))


def test_masked_softmax_matches_dropping_keys():
    scores = torch.randn(2, 4, 5, dtype=torch.float64)
    mask = torch.rand(2, 4, 5) < 0.6
    mask[..., 0] = True  # every row keeps at least one key
    pattern = masked_softmax(scores, mask)
    for index in itertools.product(range(2), range(4)):
        allowed = mask[index]
        expected = torch.zeros(5, dtype=torch.float64)
        weights = [math.exp(s) for s in scores[index][allowed].tolist()]
        expected[allowed] = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        torch.testing.assert_close(pattern[index], expected, atol=1e-15, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_masked_softmax_fully_masked_row_is_zero_with_finite_grads(dtype):
    scores = torch.randn(3, 4, dtype=dtype, requires_grad=True)
    mask = torch.tensor([[T, F_, T, F_], [F_, F_, F_, F_], [T, T, T, T]])
    pattern = masked_softmax(scores, mask)
    assert torch.equal(pattern[1], torch.zeros(4, dtype=dtype))
    assert torch.isfinite(pattern).all()
    pattern.pow(2).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert torch.equal(scores.grad[1], torch.zeros(4, dtype=dtype))


def test_minus_inf_fill_is_the_nan_pitfall():
    """The bug chapter 3 warns about is real: -inf on a fully masked row gives NaN; our fill
    does not."""
    scores = torch.zeros(1, 3)
    nothing = torch.zeros(1, 3, dtype=torch.bool)
    assert torch.isnan(scores.masked_fill(~nothing, float("-inf")).softmax(-1)).all()
    assert torch.isfinite(fill_masked(scores, nothing).softmax(-1)).all()


# ---- property tests on MultiHeadAttention -------------------------------------------------------


def _module(d_model=8, n_heads=2, seed=0):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(d_model, n_heads).double()
    with torch.no_grad():
        for p in mha.parameters():
            p.normal_(0, 0.5)
    return mha


@settings(max_examples=25, deadline=None)
@given(
    seq=st.integers(2, 8),
    cut=st.integers(1, 7),
    batch=st.integers(1, 3),
    fast=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_causality(seq, cut, batch, fast, seed):
    """Changing tokens after position `cut` never changes outputs at positions before it."""
    cut = min(cut, seq - 1)
    mha = _module(seed=seed)
    mha.fast_path = fast
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 8, generator=g, dtype=torch.float64)
    y = x.clone()
    y[:, cut:] = torch.randn(batch, seq - cut, 8, generator=g, dtype=torch.float64) * 10
    with torch.no_grad():
        out_x, out_y = mha(x, mask=causal_mask(seq)), mha(y, mask=causal_mask(seq))
    torch.testing.assert_close(out_x[:, :cut], out_y[:, :cut], atol=1e-12, rtol=0)
    assert not torch.allclose(out_x[:, cut:], out_y[:, cut:])


@settings(max_examples=25, deadline=None)
@given(
    q_len=st.integers(1, 6),
    k_len=st.integers(1, 6),
    extra=st.integers(1, 5),
    fast=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_padding_invariance(q_len, k_len, extra, fast, seed):
    """Appending any number of padding keys (with any content) never changes the output."""
    mha = _module(seed=seed)
    mha.fast_path = fast
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, q_len, 8, generator=g, dtype=torch.float64)
    context = torch.randn(2, k_len, 8, generator=g, dtype=torch.float64)
    junk = torch.randn(2, extra, 8, generator=g, dtype=torch.float64) * 100
    tokens = torch.randint(1, 50, (2, k_len), generator=g)
    padded_tokens = torch.cat([tokens, torch.zeros(2, extra, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = mha(x, context, mask=padding_mask(tokens, 0))
        padded = mha(x, torch.cat([context, junk], dim=1), mask=padding_mask(padded_tokens, 0))
    torch.testing.assert_close(padded, plain, atol=1e-12, rtol=0)


@settings(max_examples=30, deadline=None)
@given(
    q_len=st.integers(1, 5),
    k_len=st.integers(1, 5),
    fast=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_property_no_nan_for_fully_masked_rows(q_len, k_len, fast, dtype, seed):
    """Random masks, some rows with no allowed key: those rows give exactly b_O, grads stay
    finite."""
    mha = _module(seed=seed).to(dtype)
    mha.fast_path = fast
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, q_len, 8, generator=g).to(dtype).requires_grad_()
    context = torch.randn(2, k_len, 8, generator=g).to(dtype).requires_grad_()
    mask = torch.rand(2, 1, q_len, k_len, generator=g) < 0.5
    mask[0, 0, 0] = False  # at least one fully masked row
    out = mha(x, context, mask=mask)
    assert torch.isfinite(out).all()
    empty = ~mask[:, 0].any(dim=-1)  # (batch, q_pos)
    assert torch.equal(out[empty], mha.b_O.detach().expand(int(empty.sum()), -1))
    out.sum().backward()
    for tensor in (x.grad, context.grad, *(p.grad for p in mha.parameters())):
        assert torch.isfinite(tensor).all()


# ---- half precision and any score scale ---------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    log_scale=st.floats(-3, 6),
    q_len=st.integers(1, 5),
    k_len=st.integers(1, 6),
    masked=st.sampled_from([0.0, 0.5, 0.9, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_property_masked_softmax_any_mask_any_scale(dtype, log_scale, q_len, k_len, masked, seed):
    """No NaN, exact zeros where masked, finite gradients, and within 4 ulps of the exact softmax.

    Scores go up to the dtype's largest finite value (65504 in float16).
    """
    g = torch.Generator().manual_seed(seed)
    big = torch.finfo(dtype).max
    raw = torch.randn(2, q_len, k_len, generator=g, dtype=torch.float64) * 10**log_scale
    raw = raw.clamp(-big, big)
    scores = raw.to(dtype).requires_grad_()
    mask = torch.rand(2, q_len, k_len, generator=g) >= masked
    pattern = masked_softmax(scores, mask)
    assert pattern.dtype == dtype and torch.isfinite(pattern).all()
    assert (pattern[~mask] == 0).all()
    exact = scores.detach().double().masked_fill(~mask, -math.inf).softmax(-1).nan_to_num(0.0)
    torch.testing.assert_close(pattern.double(), exact, atol=4 * torch.finfo(dtype).eps, rtol=0)
    pattern.backward(torch.randn(pattern.shape, generator=g).to(dtype))
    assert torch.isfinite(scores.grad).all()


def test_masked_softmax_names_a_mask_that_is_not_bool():
    scores = torch.randn(2, 3)
    with pytest.raises(ValueError, match=r"mask: expected a bool tensor .*, got torch.int64"):
        masked_softmax(scores, torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="mask: expected a bool tensor .* got list"):
        masked_softmax(scores, [[True] * 3] * 2)
