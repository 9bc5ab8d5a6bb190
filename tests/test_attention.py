"""Attention against three independent references.

* `torch.nn.functional.scaled_dot_product_attention` (math backend) for the function,
  values and gradients: float64 to 1e-12, float32 to 1e-6.
* TransformerLens `components.Attention` with the same state dict for `MultiHeadAttention`
  (float64, 1e-12), including every hooked intermediate.
* `torch.nn.MultiheadAttention` with mapped weights and a key padding mask (float64, 1e-12).
"""

import copy
import math

import einops
import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformer_lens import HookedTransformerConfig
from transformer_lens.components import Attention
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course.attention import (
    MultiHeadAttention,
    attention_scores,
    scaled_dot_product_attention,
)
from transformer_course.masking import causal_mask, combine_masks, padding_mask

# (q batch shape, kv batch shape, q_len, k_len, d_head, d_v, mask shape or None)
CASES = [
    ((), (), 4, 4, 8, 8, None),
    ((3,), (3,), 5, 7, 4, 6, (5, 7)),
    ((2, 3), (2, 3), 3, 6, 8, 5, (2, 1, 1, 6)),
    ((2, 3), (1, 3), 6, 2, 4, 4, (2, 3, 6, 2)),
    ((2, 1), (2, 4), 1, 9, 16, 3, (1, 9)),
]


def _random_case(case, dtype, seed=0):
    q_batch, kv_batch, q_len, k_len, d_head, d_v, mask_shape = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*q_batch, q_len, d_head, generator=g, dtype=dtype)
    k = torch.randn(*kv_batch, k_len, d_head, generator=g, dtype=dtype)
    v = torch.randn(*kv_batch, k_len, d_v, generator=g, dtype=dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(*mask_shape, generator=g) < 0.7
        mask[..., 0] = True  # no fully masked row here: tested separately
    return q, k, v, mask


def _reference(q, k, v, mask):
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (t.expand(*batch, *t.shape[-2:]) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_sdpa_matches_torch_values_and_grads(case, dtype, atol):
    q, k, v, mask = _random_case(case, dtype)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    references = [t.clone().requires_grad_() for t in (q, k, v)]
    out, pattern = scaled_dot_product_attention(*inputs, mask)
    expected = _reference(*references, mask)
    torch.testing.assert_close(out, expected, atol=atol, rtol=atol)
    torch.testing.assert_close(pattern.sum(-1), torch.ones_like(pattern.sum(-1)), atol=atol, rtol=0)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    for mine, theirs in zip(inputs, references):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=10 * atol, rtol=10 * atol)


def test_sdpa_one_query_by_hand():
    q = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    # scores: (1/sqrt(2), 0); weights: softmax of those.
    w0 = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)
    out, pattern = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(
        pattern, torch.tensor([[w0, 1 - w0]], dtype=torch.float64), atol=1e-15, rtol=0
    )
    expected = torch.tensor([[w0 * 1 + (1 - w0) * 3, w0 * 2 + (1 - w0) * 4]], dtype=torch.float64)
    torch.testing.assert_close(out, expected, atol=1e-15, rtol=0)


def test_attention_scores_are_scaled():
    q = torch.full((1, 16), 1.0, dtype=torch.float64)
    k = torch.full((1, 16), 1.0, dtype=torch.float64)
    assert attention_scores(q, k).item() == 16 / 4  # q.k = 16, sqrt(16) = 4


def test_sdpa_fully_masked_row_is_zero_with_finite_grads():
    q, k, v = (torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 4, 4, dtype=torch.bool)
    mask[0, 1] = False
    mask[1, :] = False
    out, pattern = scaled_dot_product_attention(q, k, v, mask)
    assert torch.equal(out[0, 1], torch.zeros(3, dtype=torch.float64))
    assert torch.equal(out[1], torch.zeros(4, 3, dtype=torch.float64))
    assert torch.equal(pattern[1], torch.zeros(4, 4, dtype=torch.float64))
    out.pow(2).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[0, 1], torch.zeros(3, dtype=torch.float64))
    # The other rows are untouched by the empty one.
    expected = _reference(q.detach()[0], k.detach()[0], v.detach()[0], mask[0])
    torch.testing.assert_close(out[0, [0, 2, 3]], expected[[0, 2, 3]], atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    ("shapes", "mask", "message"),
    [
        (
            ((2, 5, 8), (2, 6, 4), (2, 6, 8)),
            None,
            r"k: expected last dim d_head=8 .* got 4 \(shape \(2, 6, 4\)\)",
        ),
        (((2, 5, 8), (2, 6, 8), (2, 7, 8)), None, r"v: expected k_pos=6 .* got 7"),
        (((2, 5, 8), (3, 6, 8), (3, 6, 8)), None, "batch dims must broadcast"),
        (
            ((5, 8), (6, 8), (6, 8)),
            torch.ones(6, 5, dtype=torch.bool),
            r"mask: expected a shape broadcastable to .*\(5, 6\).* got \(6, 5\)",
        ),
        (
            ((5, 8), (6, 8), (6, 8)),
            torch.ones(3, 5, 6, dtype=torch.bool),
            r"mask: .* got \(3, 5, 6\)",
        ),
        (
            ((5, 8), (6, 8), (6, 8)),
            torch.ones(5, 6),
            "mask: expected a bool tensor .* got torch.float32",
        ),
        (
            ((5,), (6, 5), (6, 5)),
            None,
            r"q: expected a floating-point tensor of shape \(\.\.\., pos, d\)",
        ),
    ],
)
def test_sdpa_errors(shapes, mask, message):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        scaled_dot_product_attention(q, k, v, mask)


def test_sdpa_dtype_mismatch():
    with pytest.raises(ValueError, match="v: expected dtype torch.float32"):
        scaled_dot_product_attention(
            torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4, dtype=torch.float64)
        )


# ---- MultiHeadAttention -----------------------------------------------------------------------


def _randomise(module, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return module


def _tl_attention(d_model, n_heads, d_head, seed=0):
    cfg = HookedTransformerConfig(
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_head,
        n_layers=1,
        n_ctx=32,
        d_vocab=11,
        act_fn="gelu",
        attn_only=True,
        dtype=torch.float64,
        device="cpu",
    )
    return _randomise(Attention(cfg), seed=seed)


def _load_from_tl(tl, d_model, n_heads, d_head):
    mine = MultiHeadAttention(d_model, n_heads, d_head).double()
    state = tl.state_dict()
    mine.load_state_dict({name: state[name] for name in mine.state_dict()})
    return mine


def _record(module, names):
    """Capture the outputs of `module`'s hook points with plain PyTorch forward hooks."""
    store = {}
    for name in names:
        getattr(module, name).register_forward_hook(
            lambda _m, _i, out, name=name: store.__setitem__(name, out)
        )
    return store


HOOKS = ["hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"]


@pytest.mark.parametrize(("d_model", "n_heads", "d_head"), [(32, 4, 8), (10, 3, 4)])
def test_mha_matches_transformer_lens_causal(d_model, n_heads, d_head):
    tl = _tl_attention(d_model, n_heads, d_head)
    mine = _load_from_tl(tl, d_model, n_heads, d_head)
    x = torch.randn(3, 7, d_model, dtype=torch.float64)
    theirs_cache = _record(tl, HOOKS)
    expected = tl(x, x, x)
    out, cache = mine.run_with_cache(x, mask=causal_mask(7))
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    for name in HOOKS:
        mine_t, theirs_t = cache[name], theirs_cache[name]
        if name == "hook_attn_scores":  # TL fills masked scores with -inf, we with finfo.min
            allowed = causal_mask(7)
            mine_t, theirs_t = mine_t[..., allowed], theirs_t[..., allowed]
        torch.testing.assert_close(mine_t, theirs_t, atol=1e-12, rtol=0, msg=name)


def test_mha_matches_transformer_lens_with_left_padding():
    """TL's attention_mask (1 = real token) combined with its causal mask; some rows see no key."""
    tl = _tl_attention(16, 2, 8, seed=1)
    mine = _load_from_tl(tl, 16, 2, 8)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    tokens = torch.tensor([[0, 0, 4, 5, 6], [7, 8, 9, 1, 2]])
    expected = tl(x, x, x, attention_mask=(tokens != 0).long())
    actual = mine(x, mask=combine_masks(causal_mask(5), padding_mask(tokens, 0)))
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


def _torch_mha(mine):
    """A torch.nn.MultiheadAttention holding `mine`'s weights."""
    d_model, n_heads = mine.d_model, mine.n_heads
    ref = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        in_proj = [
            einops.rearrange(W, "head d_model d_head -> (head d_head) d_model")
            for W in (mine.W_Q, mine.W_K, mine.W_V)
        ]
        ref.in_proj_weight.copy_(torch.cat(in_proj))
        ref.in_proj_bias.copy_(torch.cat([b.reshape(-1) for b in (mine.b_Q, mine.b_K, mine.b_V)]))
        ref.out_proj.weight.copy_(
            einops.rearrange(mine.W_O, "head d_head d_model -> d_model (head d_head)")
        )
        ref.out_proj.bias.copy_(mine.b_O)
    return ref.eval()


@pytest.mark.parametrize("fast", [False, True])
def test_mha_matches_torch_multihead_attention_with_key_padding(fast):
    mine = _randomise(MultiHeadAttention(24, 4, fast_path=fast).double(), seed=2)
    ref = _torch_mha(mine)
    x = torch.randn(3, 5, 24, dtype=torch.float64)
    context = torch.randn(3, 8, 24, dtype=torch.float64)
    tokens = torch.tensor(
        [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    )
    expected, weights = ref(
        x, context, context, key_padding_mask=tokens == 0, average_attn_weights=False
    )
    actual, cache = mine.run_with_cache(x, context, mask=padding_mask(tokens, 0))
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)
    if not fast:
        torch.testing.assert_close(cache["hook_pattern"], weights, atol=1e-12, rtol=0)
    # Self-attention with a causal mask (nn.MultiheadAttention's attn_mask: True = blocked).
    expected, _ = ref(x, x, x, attn_mask=~causal_mask(5))
    torch.testing.assert_close(mine(x, mask=causal_mask(5)), expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "cross", "empty_rows"])
def test_fast_path_equals_einsum_path(mask_kind, bias):
    """Same outputs, gradients and q, k, v hooks; the fast path projects self-attention's q, k
    and v with one matmul."""
    mine = _randomise(MultiHeadAttention(16, 4, bias=bias).double(), seed=3)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    context, mask = None, None
    if mask_kind == "causal":
        mask = causal_mask(6)
    elif mask_kind == "padding":
        mask = padding_mask(torch.tensor([[1, 2, 3, 0, 0, 0], [1, 2, 3, 4, 5, 6]]), 0)
    elif mask_kind == "cross":
        context = torch.randn(2, 9, 16, dtype=torch.float64)
        mask = combine_masks(causal_mask(6, 9), padding_mask(torch.randint(1, 5, (2, 9)), 0))
    elif mask_kind == "empty_rows":
        mask = torch.rand(2, 1, 6, 6) < 0.4
        mask[:, :, 2] = False
    results = []
    for fast in (False, True):
        mine.fast_path = fast
        mine.zero_grad()
        inp = x.clone().requires_grad_()
        out, cache = mine.run_with_cache(inp, context, mask)
        out.backward(torch.ones_like(out))
        qkv = [cache[f"hook_{name}"] for name in "qkv"]
        results.append((out, inp.grad, [p.grad.clone() for p in mine.parameters()], qkv))
    (out_e, gx_e, gp_e, qkv_e), (out_f, gx_f, gp_f, qkv_f) = results
    for a, b in zip(qkv_f, qkv_e):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    torch.testing.assert_close(out_f, out_e, atol=1e-12, rtol=0)
    torch.testing.assert_close(gx_f, gx_e, atol=1e-11, rtol=0)
    for a, b in zip(gp_f, gp_e):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0)


# An ulp at the largest output is 2**-7 of it in bf16 (8 bits of mantissa), 2**-10 in fp16.
@pytest.mark.parametrize(
    ("dtype", "rel"), [(torch.bfloat16, 5 * 2**-7), (torch.float16, 5 * 2**-10)]
)
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_mha_low_precision_is_close(dtype, rel, fast, seed):
    """Half-precision attention is within a few ulps of the largest float64 output."""
    mine = _randomise(MultiHeadAttention(32, 4).double(), seed=4)
    x = torch.randn(2, 10, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    mask = combine_masks(
        causal_mask(10), padding_mask(torch.tensor([[0] * 3 + [1] * 7, [1] * 10]), 0)
    )
    expected = mine(x, mask=mask)
    low = copy.deepcopy(mine).to(dtype)
    low.fast_path = fast
    actual = low(x.to(dtype), mask=mask)
    assert actual.dtype == dtype and torch.isfinite(actual).all()
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double(), expected, atol=rel * scale, rtol=0)


def test_mha_parameters_and_init():
    torch.manual_seed(0)
    mha = MultiHeadAttention(256, 8)
    shapes = {name: tuple(p.shape) for name, p in mha.named_parameters()}
    assert shapes == {
        "W_Q": (8, 256, 32),
        "W_K": (8, 256, 32),
        "W_V": (8, 256, 32),
        "W_O": (8, 32, 256),
        "b_Q": (8, 32),
        "b_K": (8, 32),
        "b_V": (8, 32),
        "b_O": (256,),
    }
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        weight = getattr(mha, name)
        assert abs(weight.mean().item()) < 1e-3
        assert abs(weight.std().item() - 0.02) < 1e-3, name
    for name in ("b_Q", "b_K", "b_V", "b_O"):
        assert torch.equal(getattr(mha, name), torch.zeros_like(getattr(mha, name))), name
    no_bias = MultiHeadAttention(16, 2, d_head=5, bias=False)
    assert sorted(n for n, _ in no_bias.named_parameters()) == ["W_K", "W_O", "W_Q", "W_V"]
    assert no_bias(torch.randn(1, 3, 16)).shape == (1, 3, 16)


def test_mha_hooks_are_named_inside_a_larger_model():
    class Block(HookedRootModule):
        def __init__(self):
            super().__init__()
            self.attn = MultiHeadAttention(16, 4)
            self.setup()

        def forward(self, x):
            return self.attn(x, mask=causal_mask(x.shape[1]))

    _, cache = Block().run_with_cache(torch.randn(2, 5, 16))
    assert sorted(cache.keys()) == sorted(f"attn.{name}" for name in HOOKS)
    assert cache["attn.hook_pattern"].shape == (2, 4, 5, 5)
    assert cache["attn.hook_q"].shape == (2, 5, 4, 4)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: MultiHeadAttention(10, 3),
            "d_model: expected a multiple of n_heads=3 when d_head is not given, got 10",
        ),
        (lambda: MultiHeadAttention(0, 2), "d_model: expected a positive int, got 0"),
        (lambda: MultiHeadAttention(8, 2, d_head=0), "d_head: expected a positive int, got 0"),
        (
            lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 6)),
            r"x: expected shape \(batch, pos, d_model=8\) with pos >= 1, got shape \(2, 3, 6\)",
        ),
        (
            lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(2, 4, 5)),
            r"context: expected .*d_model=8.* got shape \(2, 4, 5\)",
        ),
        (
            lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(3, 4, 8)),
            "context: expected batch size 2",
        ),
        (
            lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), mask=causal_mask(4)),
            r"mask: expected a shape broadcastable to .*\(2, 2, 3, 3\)",
        ),
        (
            lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), mask=torch.ones(3, 3)),
            "mask: expected a bool tensor",
        ),
    ],
)
def test_mha_errors(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# ---- half precision, any score scale, NaN in padding, dtype errors ------------------------------


def _exact_attention(q, k, v, mask):
    """float64 attention on the same (already rounded) inputs, fully masked rows zero."""
    q, k, v = q.double(), k.double(), v.double()
    pattern = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    return pattern.softmax(-1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_half_precision_scores_beyond_float16_range(dtype):
    """q.k / sqrt(d) of about 1e5 overflows float16; PyTorch's SDPA handles it, and so must we."""
    g = torch.Generator().manual_seed(0)
    q, k = (300 * torch.randn(2, 5, 16, generator=g, dtype=torch.float64)).to(dtype).unbind(0)
    v = torch.randn(6, 16, generator=g, dtype=torch.float64)[:5].to(dtype)
    mask = causal_mask(5)
    assert (q.double() @ k.double().T / 4).abs().max() > torch.finfo(torch.float16).max
    out, pattern = scaled_dot_product_attention(q, k, v, mask)
    theirs = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
    assert out.dtype == pattern.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(theirs).all()
    expected = _exact_attention(q, k, v, mask)
    tolerance = 4 * torch.finfo(dtype).eps * v.abs().max().item()
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=0)
    torch.testing.assert_close(theirs.double(), expected, atol=tolerance, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    log_scale=st.floats(-2, 3.3),
    q_len=st.integers(1, 5),
    k_len=st.integers(1, 6),
    masked=st.sampled_from([0.0, 0.5, 1.0]),
    seed=st.integers(0, 2**16),
)
# float16 scores overflow here, which gave NaN before they were computed in float32:
@example(dtype=torch.float16, log_scale=3.0, q_len=4, k_len=5, masked=0.0, seed=0)
def test_property_sdpa_finite_at_any_scale_and_mask(dtype, log_scale, q_len, k_len, masked, seed):
    """Scores from about 1e-4 to 1e7 (float16 overflows at 65504), any mask (fully masked rows
    included): finite outputs in the input dtype, each a weighted average of the values, and
    finite gradients."""
    g = torch.Generator().manual_seed(seed)
    q, k = (
        (torch.randn(2, n, 8, generator=g, dtype=torch.float64) * 10**log_scale)
        .to(dtype)
        .requires_grad_()
        for n in (q_len, k_len)
    )
    v = torch.randn(2, k_len, 8, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    mask = torch.rand(2, q_len, k_len, generator=g) >= masked
    out, pattern = scaled_dot_product_attention(q, k, v, mask)
    assert out.dtype == pattern.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(pattern).all()
    assert out.abs().max() <= v.abs().max() * (1 + 4 * torch.finfo(dtype).eps)
    assert (out[~mask.any(-1)] == 0).all()
    out.backward(torch.randn(out.shape, generator=g).to(dtype))
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all()


def test_nan_value_at_a_padded_key_does_not_leak():
    """Keys and values no query may attend are zeroed: their weight is 0, but 0 * NaN is NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    mask = padding_mask(torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0]]), 0)[:, 0]  # (batch, 1, k_pos)
    poisoned = v.clone()
    poisoned[0, 3] = math.nan
    poisoned[1, 2:] = math.inf
    clean, _ = scaled_dot_product_attention(q, k, v, mask)
    out, _ = scaled_dot_product_attention(q, k, poisoned, mask)
    torch.testing.assert_close(out, clean, atol=0, rtol=0)

    mha = _randomise(MultiHeadAttention(8, 2).double(), seed=1)
    context = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    bad_context = context.clone()
    bad_context[0, 3] = math.nan  # NaN inputs at a padding position give NaN values there
    for fast in (False, True):
        mha.fast_path = fast
        expected = mha(q, context, mask=mask[:, None])
        actual = mha(q, bad_context, mask=mask[:, None])
        torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


def test_nan_value_at_an_attended_key_reaches_the_outputs_as_in_torch():
    """Documented, not changed: a NaN at a key some query attends is data and propagates."""
    q, k, v = (torch.randn(3, 8, dtype=torch.float64) for _ in range(3))
    v[1, 0] = math.nan
    out, _ = scaled_dot_product_attention(q, k, v, causal_mask(3))
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(3))
    assert torch.equal(out.isnan(), theirs.isnan()) and out[1:, 0].isnan().all()


def test_mha_input_of_another_dtype_names_the_argument_and_both_dtypes():
    mha = MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match=r"x: expected dtype torch.float32 \(the dtype of the"):
        mha(x.double())
    with pytest.raises(ValueError, match=r"x: .* got torch.float64"):
        mha(x.double())
    with pytest.raises(ValueError, match=r"context: expected dtype torch.float32 .*torch.float16"):
        mha(x, x.half())
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts inputs and weights itself
        assert mha(x.bfloat16()).shape == (2, 3, 8)


@pytest.mark.parametrize("fast", [False, True])
def test_a_key_mask_of_any_broadcastable_shape_works_as_in_torch(fast):
    """A mask of shape (k_len,) or (1, k_len) broadcasts over batch, heads and queries, as
    `F.scaled_dot_product_attention` accepts it: same output as the full mask."""
    generator = torch.Generator().manual_seed(8)
    q = torch.randn(2, 3, 4, 8, generator=generator, dtype=torch.float64)
    keys = torch.tensor([True, False, True, True, False])
    full = keys.expand(2, 3, 4, 5)
    k = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(2, 3, 5, 8, generator=generator, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=full)
    for mask in (keys, keys[None]):
        out, _ = scaled_dot_product_attention(q, k, v, mask)
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    mha = _randomise(MultiHeadAttention(16, 4, fast_path=fast).double(), seed=9)
    x = torch.randn(2, 5, 16, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(mha(x, mask=keys), mha(x, mask=keys.expand(2, 1, 5, 5)))
