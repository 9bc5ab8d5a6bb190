"""The chapter 2 checkers accept the reference, reject blanks with their hint, and name each classic bug."""

import math

import einops
import pytest
import torch
from torch import nn

from transformer_course.attention import MultiHeadAttention, attention_scores, scaled_dot_product_attention
from transformer_course.checks import CheckFailure
from transformer_course.checks.attention import (
    check_attention_scores,
    check_multi_head_attention,
    check_scaled_dot_product_attention,
)


def test_reference_passes(capsys):
    check_attention_scores(attention_scores)
    check_scaled_dot_product_attention(scaled_dot_product_attention)
    check_multi_head_attention(MultiHeadAttention)
    out = capsys.readouterr().out
    for name in ("attention_scores", "scaled_dot_product_attention", "MultiHeadAttention"):
        assert f"✓ {name} passes every check" in out


def _blank(*args, **kwargs):
    raise NotImplementedError("use einops.einsum with named axes")


class BlankMHA(MultiHeadAttention):
    def forward(self, x, context=None, mask=None):
        raise NotImplementedError("project x with W_Q first")


@pytest.mark.parametrize(
    ("checker", "blank", "hint"),
    [(check_attention_scores, _blank, "use einops.einsum"),
     (check_scaled_dot_product_attention, _blank, "use einops.einsum"),
     (check_multi_head_attention, BlankMHA, "project x with W_Q first")],
)
def test_blank_fails_with_its_hint(checker, blank, hint):
    with pytest.raises(CheckFailure, match="not implemented yet") as info:
        checker(blank)
    assert hint in str(info.value)


# ---- buggy learner code, one catalogue entry each ---------------------------------------------

def scores_unscaled(q, k):
    return q @ k.transpose(-1, -2)


def scores_over_d_head(q, k):
    return q @ k.transpose(-1, -2) / q.shape[-1]


@pytest.mark.parametrize(("fn", "word"), [(scores_unscaled, "sqrt(d_head)"), (scores_over_d_head, "square root")])
def test_attention_scores_bugs(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_attention_scores(fn)
    assert word in str(info.value)


def sdpa_variant(bug):
    def sdpa(q, k, v, mask=None):
        scores = q @ k.transpose(-1, -2)
        if bug != "no_scale":
            scores = scores / math.sqrt(q.shape[-1])
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf") if bug == "minus_inf" else torch.finfo(scores.dtype).min)
        pattern = scores.softmax(dim=-2 if bug == "query_softmax" else -1)
        if mask is not None and bug != "minus_inf":
            pattern = pattern.masked_fill(~mask, 0.0)
        return pattern @ v, pattern
    return sdpa


def test_sdpa_variant_without_bug_passes():
    check_scaled_dot_product_attention(sdpa_variant(""))


@pytest.mark.parametrize(
    ("bug", "word"),
    [("no_scale", "sqrt(d_head)"), ("query_softmax", "dim=-1"), ("minus_inf", "finfo")],
)
def test_sdpa_bugs(bug, word):
    with pytest.raises(CheckFailure) as info:
        check_scaled_dot_product_attention(sdpa_variant(bug))
    assert word in str(info.value)


def _plus(x, bias):
    return x if bias is None else x + bias


class BuggyMHA(MultiHeadAttention):
    """A complete multi-head attention with one switchable bug."""

    bug = ""

    def reset_parameters(self):
        super().reset_parameters()
        if self.bug == "bias_ones":
            for bias in (self.b_Q, self.b_K, self.b_V, self.b_O):
                nn.init.ones_(bias)

    def forward(self, x, context=None, mask=None):
        context = x if context is None else context
        q = self.hook_q(_plus(einops.einsum(x, self.W_Q, "b p m, h m d -> b p h d"), self.b_Q))
        k = self.hook_k(_plus(einops.einsum(context, self.W_K, "b p m, h m d -> b p h d"), self.b_K))
        v = self.hook_v(_plus(einops.einsum(context, self.W_V, "b p m, h m d -> b p h d"), self.b_V))
        scores = einops.einsum(q, k, "b q h d, b k h d -> b h q k")
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d_head)
        if mask is not None:
            fill = float("-inf") if self.bug == "minus_inf" else torch.finfo(scores.dtype).min
            scores = scores.masked_fill(~mask, fill)
        scores = self.hook_attn_scores(scores)
        pattern = scores.softmax(dim=-2 if self.bug == "query_softmax" else -1)
        if mask is not None and self.bug != "minus_inf":
            pattern = pattern.masked_fill(~mask, 0.0)
        pattern = self.hook_pattern(pattern)
        z = self.hook_z(einops.einsum(pattern, v, "b h q k, b k h d -> b q h d"))
        order = "b q h d -> b q (d h)" if self.bug == "concat_order" else "b q h d -> b q (h d)"
        return einops.rearrange(z, order) @ einops.rearrange(self.W_O, "h d m -> (h d) m") + (0 if self.b_O is None else self.b_O)


def buggy(bug):
    return type(f"MHA_{bug or 'ok'}", (BuggyMHA,), {"bug": bug})


def test_mha_variant_without_bug_passes():
    check_multi_head_attention(buggy(""))


@pytest.mark.parametrize(
    ("bug", "word"),
    [("bias_ones", "zero"), ("concat_order", "wrong order"), ("no_scale", "sqrt(d_head)"),
     ("query_softmax", "dim=-1"), ("minus_inf", "finfo")],
)
def test_mha_bugs(bug, word):
    with pytest.raises(CheckFailure) as info:
        check_multi_head_attention(buggy(bug))
    assert word in str(info.value)


def test_mha_wrong_parameter_shapes():
    class Transposed(MultiHeadAttention):
        def __init__(self, d_model, n_heads):
            super().__init__(d_model, n_heads)
            self.W_O = nn.Parameter(torch.randn(n_heads, d_model, d_model // n_heads) * 0.02)

    with pytest.raises(CheckFailure, match="TransformerLens names and shapes"):
        check_multi_head_attention(Transposed)
