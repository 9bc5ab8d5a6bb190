"""The chapter 2 checkers accept the reference and valid alternatives, reject blanks with their
hint, and name each classic bug."""

import math

import einops
import pytest
import torch
import torch.nn.functional as F
from checking import fails
from torch import nn

from transformer_course import validate
from transformer_course.attention import (
    MultiHeadAttention,
    attention_scores,
    scaled_dot_product_attention,
)
from transformer_course.checks.attention import (
    check_attention_scores,
    check_multi_head_attention,
    check_scaled_dot_product_attention,
)
from transformer_course.checks.harness import CheckFailure
from transformer_course.masking import causal_mask
from transformer_course.runtime import upcast


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
    def forward(self, x, context=None, mask=None, *, causal=False):
        raise NotImplementedError("project x with W_Q first")


@pytest.mark.parametrize(
    ("checker", "blank", "hint"),
    [
        (check_attention_scores, _blank, "use einops.einsum"),
        (check_scaled_dot_product_attention, _blank, "use einops.einsum"),
        (check_multi_head_attention, BlankMHA, "project x with W_Q first"),
    ],
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


@pytest.mark.parametrize(
    ("fn", "word"), [(scores_unscaled, "sqrt(d_head)"), (scores_over_d_head, "square root")]
)
def test_attention_scores_bugs(fn, word):
    with pytest.raises(CheckFailure) as info:
        check_attention_scores(fn)
    assert word in str(info.value)


def test_attention_scores_without_the_upcast_is_caught():
    """float16 scores for float16 inputs: the stated rule is float32, and the dot products of
    the check overflow float16."""
    fails(check_attention_scores, lambda q, k: scores_unscaled(q, k) / 4, "float32 scores")


def test_attention_scores_upcast_after_the_product_is_caught():
    def late(q, k):
        return (q @ k.transpose(-1, -2)).float() / math.sqrt(q.shape[-1])

    fails(check_attention_scores, late, "float16 q and k", "inf where", "upcast q and k")


def test_attention_scores_with_its_own_upcast_passes():
    def own(q, k):
        if q.dtype in (torch.float16, torch.bfloat16):
            q, k = q.float(), k.float()
        return torch.einsum("...qd,...kd->...qk", q, k) / math.sqrt(q.shape[-1])

    check_attention_scores(own)


def _softmax(scores, how):
    """Three correct softmaxes over the last dim, and the naive one that overflows."""
    if how == "F.softmax":
        return F.softmax(scores, dim=-1)
    if how == "manual":
        e = (scores - scores.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)
    if how == "naive_exp":
        return scores.exp() / scores.exp().sum(-1, keepdim=True)
    return scores.softmax(dim=-1)


def sdpa_variant(bug="", *, product="matmul", softmax="method"):
    def sdpa(q, k, v, mask=None):
        if bug != "unvalidated":
            validate.attention_inputs(q, k, v, mask)
        if product == "einsum":
            scores = einops.einsum(q, k, "... q d, ... k d -> ... q k")
        else:
            scores = q @ k.transpose(-1, -2)
        if bug != "no_scale":
            scores = scores / math.sqrt(q.shape[-1])
        if mask is not None or bug == "mask_none_crash":
            forbidden = mask if bug.startswith("inverted") else ~mask
            fill = (
                float("-inf")
                if bug in ("minus_inf", "inverted_minus_inf")
                else torch.finfo(scores.dtype).min
            )
            scores = scores.masked_fill(forbidden, fill)
        pattern = _softmax(scores, softmax) if bug != "query_softmax" else scores.softmax(-2)
        if mask is not None and bug not in ("minus_inf", "inverted_minus_inf"):
            pattern = pattern.masked_fill(forbidden, 0.0)
        return pattern @ v, pattern

    return sdpa


@pytest.mark.parametrize(
    ("product", "softmax"),
    [("matmul", "method"), ("einsum", "F.softmax"), ("einsum", "manual")],
)
def test_sdpa_valid_alternatives_pass(product, softmax):
    check_scaled_dot_product_attention(sdpa_variant(product=product, softmax=softmax))


def test_sdpa_that_refuses_bad_inputs_its_own_way_passes():
    def own_checks(q, k, v, mask=None):
        if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2]:
            raise ValueError(f"k, v: shapes {tuple(k.shape)}, {tuple(v.shape)} do not fit q")
        if mask is not None and mask.ndim > q.ndim:
            raise ValueError(f"mask: too many dims, {tuple(mask.shape)}")
        return sdpa_variant("unvalidated")(q, k, v, mask)

    check_scaled_dot_product_attention(own_checks)


def test_sdpa_without_its_input_checks_is_caught():
    fails(check_scaled_dot_product_attention, sdpa_variant("unvalidated"), "d_head 6", "ValueError")


def test_sdpa_that_upcasts_half_precision_passes():
    def upcasting(q, k, v, mask=None):
        dtype = q.dtype
        if dtype in (torch.float16, torch.bfloat16):
            q, k, v = q.float(), k.float(), v.float()
        out, pattern = sdpa_variant(softmax="F.softmax")(q, k, v, mask)
        return out.to(dtype), pattern.to(dtype)

    check_scaled_dot_product_attention(upcasting)


@pytest.mark.parametrize(
    ("bug", "word"),
    [
        ("no_scale", "sqrt(d_head)"),
        ("query_softmax", "dim=-1"),
        ("minus_inf", "finfo"),
        ("inverted", "True means *may attend*"),
        ("inverted_minus_inf", "True means *may attend*"),
        ("mask_none_crash", "defaults to None"),
    ],
)
def test_sdpa_bugs(bug, word):
    with pytest.raises(CheckFailure) as info:
        check_scaled_dot_product_attention(sdpa_variant(bug))
    assert word in str(info.value)
    if bug.startswith("inverted"):
        assert "dim=-1" not in str(info.value)


def test_sdpa_naive_exp_overflows_with_a_hint():
    with pytest.raises(CheckFailure, match="scores in the thousands") as info:
        check_scaled_dot_product_attention(sdpa_variant(softmax="naive_exp"))
    assert "subtract each row's maximum" in str(info.value)


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

    def forward(self, x, context=None, mask=None, *, causal=False, cache=None):
        context = x if context is None else context
        q = einops.einsum(x, self.W_Q, "b p m, h m d -> b p h d")
        q = self.hook_q(q if self.bug == "hook_q_before_bias" else _plus(q, self.b_Q))
        if self.bug == "hook_q_before_bias":
            q = _plus(q, self.b_Q)
        k = self.hook_k(
            _plus(einops.einsum(context, self.W_K, "b p m, h m d -> b p h d"), self.b_K)
        )
        v = self.hook_v(
            _plus(einops.einsum(context, self.W_V, "b p m, h m d -> b p h d"), self.b_V)
        )
        if cache is not None and self.bug != "ignore_cache":
            heads_first = (einops.rearrange(t, "b p h d -> b h p d") for t in (k, v))
            k, v = (einops.rearrange(t, "b h p d -> b p h d") for t in cache.extend(*heads_first))
        if causal and self.bug != "ignore_causal":
            allowed = causal_mask(x.shape[1], k.shape[1])
            mask = allowed if mask is None else allowed & mask
        honours_fast_path = ("", "tl_style", "ignore_cache", "pattern_hook_discarded")
        honours_fast_path += ("half_pattern_kept_float32",)
        fused = self.fast_path if self.bug in honours_fast_path else False
        if self.bug == "always_fused" or fused:
            heads = (einops.rearrange(t, "b p h d -> b h p d") for t in (q, k, v))
            z = F.scaled_dot_product_attention(*heads, attn_mask=mask)
            z = self.hook_z(einops.rearrange(z, "b h q d -> b q h d"))
            out = einops.einsum(z, self.W_O, "b q h d, h d m -> b q m")
            return _plus(out, self.b_O)
        if self.bug == "half_pattern_kept_float32":  # upcast, never cast back for v
            q, k = upcast(q), upcast(k)
        scores = einops.einsum(q, k, "b q h d, b k h d -> b h q k")
        if self.bug != "no_scale":
            scores = scores / math.sqrt(self.d_head)
        if mask is not None or self.bug == "mask_none_crash":
            forbidden = mask if self.bug == "inverted" else ~mask
            fill = (
                float("-inf")
                if self.bug in ("minus_inf", "tl_style")
                else torch.finfo(scores.dtype).min
            )
            scores = scores.masked_fill(forbidden, fill)
        scores = self.hook_attn_scores(scores)
        pattern = scores.softmax(dim=-2 if self.bug == "query_softmax" else -1)
        if self.bug == "tl_style":  # TransformerLens: -inf fill, NaN rows become zeros
            pattern = pattern.nan_to_num(0.0)
        elif mask is not None and self.bug != "minus_inf":
            pattern = pattern.masked_fill(forbidden, 0.0)
        seen = scores if self.bug == "pattern_hook_gets_scores" else pattern
        if self.bug == "pattern_heads_last":  # the hook gets (batch, q_pos, head, k_pos)
            hooked = self.hook_pattern(seen.transpose(1, 2)).transpose(1, 2)
        else:
            hooked = self.hook_pattern(seen)
        pattern = pattern if self.bug == "pattern_hook_discarded" else hooked
        z = self.hook_z(einops.einsum(pattern, v, "b h q k, b k h d -> b q h d"))
        order = "b q h d -> b q (d h)" if self.bug == "concat_order" else "b q h d -> b q (h d)"
        out = einops.rearrange(z, order) @ einops.rearrange(self.W_O, "h d m -> (h d) m")
        return _plus(out, self.b_O)


def buggy(bug):
    """The valid multi-head attention (bug="") honours fast_path; each bug ignores it."""
    return type(f"MHA_{bug or 'ok'}", (BuggyMHA,), {"bug": bug})


@pytest.mark.parametrize("variant", ["", "tl_style"])
def test_mha_valid_alternatives_pass(variant):
    """Concatenated heads times a flattened W_O, and TransformerLens's -inf fill with NaN rows
    zeroed, are as good as the reference's einsums."""
    check_multi_head_attention(buggy(variant))


@pytest.mark.parametrize(
    ("bug", "word"),
    [
        ("bias_ones", "zero"),
        ("concat_order", "wrong order"),
        ("no_scale", "sqrt(d_head)"),
        ("query_softmax", "dim=-1"),
        ("minus_inf", "finfo"),
        ("inverted", "True means *may attend*"),
        ("ignore_causal", "causal=True"),
        ("mask_none_crash", "defaults to None"),
        ("pattern_hook_gets_scores", "belongs at `hook_attn_scores`"),
        ("hook_q_before_bias", "b_Q"),
        ("pattern_hook_discarded", "use what self.hook_pattern(...) returns"),
        ("pattern_heads_last", "hook_pattern`: expected shape (2, 4, 6, 6), got (2, 6, 4, 6)"),
    ],
)
def test_mha_bugs(bug, word):
    with pytest.raises(CheckFailure) as info:
        check_multi_head_attention(buggy(bug))
    assert word in str(info.value)
    if bug == "inverted":
        assert "dim=-1" not in str(info.value)


@pytest.mark.parametrize(
    ("bug", "words"),
    [
        ("", []),
        ("always_fused", ["fast_path=False", "hook_attn_scores", "never received"]),
        ("ignore_fast_path", ["fast_path=True", "was not called", "hook_pattern are not run"]),
    ],
)
def test_mha_that_ignores_fast_path_is_named(bug, words):
    """fast_path=True: F.scaled_dot_product_attention and no pattern hooks; fast_path=False:
    the einsum path through hook_attn_scores and hook_pattern."""
    if not words:
        check_multi_head_attention(buggy(bug))
        return
    with pytest.raises(CheckFailure) as info:
        check_multi_head_attention(buggy(bug))
    for word in words:
        assert word in str(info.value), str(info.value)


def test_mha_that_ignores_bias_false_is_named():
    class AlwaysBias(MultiHeadAttention):
        def __init__(self, d_model, n_heads, d_head=None, bias=True):
            super().__init__(d_model, n_heads, d_head)

    with pytest.raises(CheckFailure, match=r"bias=False(.|\n)*register the biases as None"):
        check_multi_head_attention(AlwaysBias)


def test_mha_wrong_parameter_shapes():
    class Transposed(MultiHeadAttention):
        def __init__(self, d_model, n_heads):
            super().__init__(d_model, n_heads)
            self.W_O = nn.Parameter(torch.randn(n_heads, d_model, d_model // n_heads) * 0.02)

    with pytest.raises(CheckFailure, match="TransformerLens names and shapes"):
        check_multi_head_attention(Transposed)


def test_sdpa_that_returns_float32_for_half_inputs_is_named():
    def float32_results(q, k, v, mask=None):
        if q.dtype == torch.float16:
            q, k, v = q.float(), k.float(), v.float()
        return sdpa_variant()(q, k, v, mask)

    with pytest.raises(CheckFailure, match=r"float16 inputs(.|\n)*expected float16 results"):
        check_scaled_dot_product_attention(float32_results)


def test_mha_that_crashes_in_half_precision_is_caught():
    fails(
        check_multi_head_attention,
        buggy("half_pattern_kept_float32"),
        "torch.float16",
        "bring the pattern to v's dtype",
    )


def test_mha_that_ignores_the_kv_cache_is_named():
    with pytest.raises(CheckFailure, match=r"cache=\.\.\.\), fast_path=False(.|\n)*cache.extend"):
        check_multi_head_attention(buggy("ignore_cache"))
