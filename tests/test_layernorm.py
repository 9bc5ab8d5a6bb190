"""LayerNorm and RMSNorm against PyTorch's functional versions and TransformerLens' components.

Tolerances: float64 comparisons use atol=1e-12 (the two computations differ only in rounding
order); float32 comparisons state their own tolerance next to the assertion.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformer_lens.components import LayerNorm as TLLayerNorm
from transformer_lens.components import RMSNorm as TLRMSNorm
from transformer_lens.config import HookedTransformerConfig

from transformer_course.layernorm import LayerNorm, RMSNorm

D = 16
TIGHT = dict(atol=1e-12, rtol=0)


def random_layernorm(d_model: int = D, eps: float = 1e-5, dtype=torch.float64) -> LayerNorm:
    """A LayerNorm with non-trivial scale and shift, so a test can't pass with w=1, b=0."""
    ln = LayerNorm(d_model, eps=eps).to(dtype)
    with torch.no_grad():
        ln.w.copy_(torch.randn(d_model, dtype=dtype))
        ln.b.copy_(torch.randn(d_model, dtype=dtype))
    return ln


def tl_config(dtype=torch.float64, eps: float = 1e-5) -> HookedTransformerConfig:
    return HookedTransformerConfig(
        n_layers=1, d_model=D, n_ctx=8, d_head=4, act_fn="gelu_new", eps=eps, dtype=dtype
    )


@pytest.mark.parametrize("shape", [(D,), (3, D), (2, 5, D), (2, 3, 4, D)])
def test_layernorm_matches_functional_float64(shape):
    torch.manual_seed(0)
    ln = random_layernorm()
    x = torch.randn(shape, dtype=torch.float64) * 3 + 1
    expected = F.layer_norm(x, (D,), ln.w, ln.b, eps=ln.eps)
    torch.testing.assert_close(ln(x), expected, **TIGHT)


def test_layernorm_default_parameters_match_torch_module():
    torch.manual_seed(0)
    x = torch.randn(4, 7, D, dtype=torch.float64)
    reference = torch.nn.LayerNorm(D, eps=1e-5, dtype=torch.float64)
    ours = LayerNorm(D).double()
    assert torch.equal(ours.w, reference.weight) and torch.equal(ours.b, reference.bias)
    torch.testing.assert_close(ours(x), reference(x), **TIGHT)


def test_layernorm_gradients_match_functional_float64():
    torch.manual_seed(0)
    ln = random_layernorm()
    x = torch.randn(3, 5, D, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 5, D, dtype=torch.float64)
    ours = torch.autograd.grad((ln(x) * upstream).sum(), (x, ln.w, ln.b))
    w, b = ln.w.detach().clone().requires_grad_(), ln.b.detach().clone().requires_grad_()
    reference = torch.autograd.grad(
        (F.layer_norm(x, (D,), w, b, eps=ln.eps) * upstream).sum(), (x, w, b)
    )
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_layernorm_zero_variance_rows_give_the_shift():
    """A constant vector has variance 0: eps inside the sqrt turns 0/0 into 0, so the output
    is b."""
    ln = random_layernorm()
    x = torch.stack([torch.full((D,), 3.0), torch.zeros(D), torch.full((D,), -1e6)]).double()
    out = ln(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ln.b.detach().expand(3, D), **TIGHT)
    torch.testing.assert_close(out, F.layer_norm(x, (D,), ln.w, ln.b, eps=ln.eps), **TIGHT)


def test_layernorm_large_offset_float32():
    """1e4 + unit noise in float32: subtracting the mean before squaring keeps the result accurate.

    Tolerance atol=1e-2 against the float64 result of the same float32 input: float32 carries
    about 7 significant digits, 4 of which the offset uses up, and `F.layer_norm` in float32 is
    off by the same order (about 2e-3 here). The one-pass formula E[x^2] - E[x]^2 is off by far
    more (its variance can even come out negative), which this test asserts too.
    """
    torch.manual_seed(0)
    x = (1e4 + torch.randn(4, 10, D)).float()
    ln = random_layernorm(dtype=torch.float32)
    exact = F.layer_norm(x.double(), (D,), ln.w.double(), ln.b.double(), eps=ln.eps)
    ours = ln(x)
    torch.testing.assert_close(ours.double(), exact, atol=1e-2, rtol=0)
    torch.testing.assert_close(
        ours, F.layer_norm(x, (D,), ln.w, ln.b, eps=ln.eps), atol=1e-2, rtol=0
    )
    naive_var = x.pow(2).mean(-1, keepdim=True) - x.mean(-1, keepdim=True).pow(2)
    naive = (x - x.mean(-1, keepdim=True)) / (naive_var + ln.eps).sqrt() * ln.w + ln.b
    assert not ((naive.double() - exact).abs() < 1e-1).all()


def test_layernorm_gradcheck():
    torch.manual_seed(0)
    ln = random_layernorm(d_model=6)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)

    def fn(x, w, b):
        return torch.func.functional_call(ln, {"w": w, "b": b}, (x,))

    w = ln.w.detach().clone().requires_grad_()
    b = ln.b.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_layernorm_loads_transformer_lens_state_dict():
    torch.manual_seed(0)
    reference = TLLayerNorm(tl_config())
    with torch.no_grad():
        reference.w.copy_(torch.randn(D))
        reference.b.copy_(torch.randn(D))
    ours = LayerNorm(D, eps=reference.eps).double()
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 5, D, dtype=torch.float64) * 4
    torch.testing.assert_close(ours(x), reference(x), **TIGHT)


def test_layernorm_hook_points_match_transformer_lens():
    torch.manual_seed(0)
    reference = TLLayerNorm(tl_config())
    ours = LayerNorm(D).double()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    seen: dict[str, torch.Tensor] = {}
    for prefix, module in (("ours", ours), ("tl", reference)):
        for name in ("hook_scale", "hook_normalized"):
            getattr(module, name).register_forward_hook(
                lambda _m, _i, out, key=f"{prefix}.{name}": seen.__setitem__(key, out)
            )
        module(x)
    for name in ("hook_scale", "hook_normalized"):
        torch.testing.assert_close(seen[f"ours.{name}"], seen[f"tl.{name}"], **TIGHT)
    # hook_scale is the biased standard deviation with eps inside the square root.
    std = (x.var(dim=-1, unbiased=False, keepdim=True) + 1e-5).sqrt()
    torch.testing.assert_close(seen["ours.hook_scale"], std, **TIGHT)


@pytest.mark.parametrize("shape", [(D,), (2, 5, D), (2, 3, 4, D)])
def test_rmsnorm_matches_functional_float64(shape):
    torch.manual_seed(0)
    norm = RMSNorm(D).double()
    with torch.no_grad():
        norm.w.copy_(torch.randn(D))
    x = torch.randn(shape, dtype=torch.float64) + 2
    torch.testing.assert_close(norm(x), F.rms_norm(x, (D,), norm.w, eps=norm.eps), **TIGHT)


def test_rmsnorm_loads_transformer_lens_state_dict():
    torch.manual_seed(0)
    reference = TLRMSNorm(tl_config(eps=1e-6))
    with torch.no_grad():
        reference.w.copy_(torch.randn(D))
    ours = RMSNorm(D).double()
    ours.load_state_dict(reference.state_dict(), strict=True)
    x = torch.randn(2, 5, D, dtype=torch.float64)
    torch.testing.assert_close(ours(x), reference(x), **TIGHT)


def test_rmsnorm_gradcheck():
    torch.manual_seed(0)
    norm = RMSNorm(5).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(norm, (x,))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_wrong_last_dim_names_both_sizes(cls):
    norm = cls(16)
    with pytest.raises(ValueError, match=r"d_model=16, got 8 \(shape \(2, 5, 8\)\)"):
        norm(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="d_model=16"):
        norm(torch.tensor(1.0))


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_integer_input_is_rejected(cls):
    with pytest.raises(TypeError, match="floating-point"):
        cls(4)(torch.ones(2, 4, dtype=torch.long))


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="d_model"):
        LayerNorm(0)
    with pytest.raises(ValueError, match="eps"):
        RMSNorm(4, eps=-1.0)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan"), float("inf"), 1e-50])
def test_eps_that_would_give_nan_is_refused(cls, eps):
    with pytest.raises(ValueError, match=rf"eps: expected a finite number >= 1.18e-38, got {eps}"):
        cls(8, eps=eps)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_constructor_arguments_of_the_wrong_type_are_named(cls):
    with pytest.raises(TypeError, match="d_model: expected an int, got str '8'"):
        cls("8")
    with pytest.raises(TypeError, match="d_model: expected an int, got bool"):
        cls(True)
    with pytest.raises(TypeError, match="eps: expected a number, got str"):
        cls(8, eps="1e-5")


# ---- half precision -------------------------------------------------------------------------
# Tolerance, in every dtype: our error against the exact answer (float64 on the same, already
# rounded, input) is at most the larger of PyTorch's own error in that dtype and the error that
# computing in float32 (float64 for float64) allows, 8 eps (|offset| + scale) / scale max|w|,
# plus 4 units in the last place of the output, which both round once.


def _ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]),
    offset=st.floats(-1e4, 1e4),
    log_scale=st.floats(-2, 2),
    seed=st.integers(0, 2**16),
)
def test_property_norms_as_accurate_as_torch_in_every_dtype(dtype, offset, log_scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = (offset + 10**log_scale * torch.randn(3, 5, D, generator=g, dtype=torch.float64)).to(dtype)
    w = torch.randn(D, generator=g, dtype=torch.float64) + 1
    b = torch.randn(D, generator=g, dtype=torch.float64)
    ln, rms = LayerNorm(D).to(dtype), RMSNorm(D).to(dtype)
    with torch.no_grad():
        ln.w.copy_(w), ln.b.copy_(b), rms.w.copy_(w)
    w, b = w.to(dtype), b.to(dtype)  # the weights the modules hold, rounded to dtype
    cases = [
        (
            ln(x),
            F.layer_norm(x, (D,), w, b, 1e-5),
            F.layer_norm(x.double(), (D,), w.double(), b.double(), 1e-5),
        ),
        (rms(x), F.rms_norm(x, (D,), w, 1e-6), F.rms_norm(x.double(), (D,), w.double(), 1e-6)),
    ]
    compute = torch.promote_types(dtype, torch.float32)
    scale = 10**log_scale
    conditioning = 8 * _ulp(compute) * (abs(offset) + scale) / scale * w.abs().max().item()
    for ours, torch_same_dtype, exact in cases:
        assert ours.dtype == dtype and torch.isfinite(ours).all()
        ours_error = (ours.double() - exact).abs().max().item()
        torch_error = (torch_same_dtype.double() - exact).abs().max().item()
        rounding = 4 * _ulp(dtype) * (1 + exact.abs().max().item())
        assert ours_error <= max(torch_error, conditioning) + rounding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_half_precision_input_beyond_256_is_normalised(cls, dtype):
    """In float16, x**2 overflows once |x| > 256, once giving `b` (LayerNorm) or 0 (RMSNorm)."""
    torch.manual_seed(0)
    x = (300 * torch.randn(4, D, dtype=torch.float64)).to(dtype)
    expected = cls(D).double()(x.double())
    y = cls(D).to(dtype)(x)
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), expected, atol=4 * _ulp(dtype) * 4, rtol=0)


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_half_precision_gradients_are_finite(cls):
    x = (1000 * torch.randn(3, D)).half().requires_grad_()
    norm = cls(D).half()
    norm(x).pow(2).sum().backward()
    assert x.grad.dtype == torch.float16 and torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in norm.parameters())
