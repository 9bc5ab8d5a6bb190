"""The chapter 4 checkers accept the reference and reject each classic bug with a targeted hint."""

from __future__ import annotations

import pytest
import torch
from checking import fails

from transformer_course import validate
from transformer_course.checks.harness import CheckFailure
from transformer_course.checks.layernorm import check_layernorm, check_rmsnorm
from transformer_course.layernorm import LayerNorm, RMSNorm


def layernorm_with(forward):
    """A LayerNorm class whose forward is `forward(self, x)`: the learner's code."""
    return type("LearnerLayerNorm", (LayerNorm,), {"forward": forward})


def rmsnorm_with(forward):
    return type("LearnerRMSNorm", (RMSNorm,), {"forward": forward})


def test_reference_layernorm_passes(capsys):
    check_layernorm(LayerNorm)
    assert "✓ LayerNorm passes every check" in capsys.readouterr().out


def test_reference_rmsnorm_passes(capsys):
    check_rmsnorm(RMSNorm)
    assert "✓ RMSNorm passes every check" in capsys.readouterr().out


def _float32_inside(x):
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def test_valid_alternatives_pass():
    """Other correct implementations pass: `torch.var_mean` with `reciprocal`, one that upcasts half
    precision with `.float()` and casts back, and an RMSNorm written with `reciprocal`."""

    def var_mean(self, x):
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x: expected last dim {self.d_model}, got shape {tuple(x.shape)}")
        y = _float32_inside(x)
        var, mean = torch.var_mean(y, dim=-1, keepdim=True, correction=0)
        scale = self.hook_scale(torch.sqrt(var + self.eps))
        normalized = self.hook_normalized((y - mean) * scale.reciprocal())
        return (normalized * self.w + self.b).to(x.dtype)

    def upcast_half(self, x):
        y = _float32_inside(validate.last_dim("x", x, self.d_model))
        centred = y - y.mean(-1, keepdim=True)
        std = self.hook_scale(centred.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt())
        return (self.hook_normalized(centred / std) * self.w + self.b).to(x.dtype)

    def rms_reciprocal(self, x):
        y = _float32_inside(validate.last_dim("x", x, self.d_model))
        scale = self.hook_scale(y.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt())
        return (self.hook_normalized(y * scale.reciprocal()) * self.w).to(x.dtype)

    check_layernorm(layernorm_with(var_mean))
    check_layernorm(layernorm_with(upcast_half))
    check_rmsnorm(rmsnorm_with(rms_reciprocal))


def _layer_norm_in(*, upcast: bool, cast_back: bool = True, half_eps_outside: bool = False):
    def forward(self, x):
        validate.last_dim("x", x, self.d_model)
        y = _float32_inside(x) if upcast else x
        if half_eps_outside and x.dtype in (torch.float16, torch.bfloat16):
            centred = y - y.mean(-1, keepdim=True)
            std = self.hook_scale(centred.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)
            return (self.hook_normalized(centred / std) * self.w + self.b).to(x.dtype)
        centred = y - y.mean(-1, keepdim=True)
        std = self.hook_scale((centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        out = self.hook_normalized(centred / std) * self.w + self.b
        return out.to(x.dtype) if cast_back else out

    return layernorm_with(forward)


def test_eps_outside_the_root_in_half_precision_is_caught():
    """A half-precision path of its own (here with eps after the square root) is checked as
    closely as the float64 one: a large eps where it shows, in float16 and bfloat16."""
    fails(
        check_layernorm,
        _layer_norm_in(upcast=True, half_eps_outside=True),
        "eps=0.25",
        "float16 input",
        "eps inside the square root",
    )


def test_a_norm_that_does_not_check_its_input_is_caught():
    def unchecked(self, x):
        y = _float32_inside(x)
        centred = y - y.mean(-1, keepdim=True)
        std = self.hook_scale((centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return (self.hook_normalized(centred / std) * self.w + self.b).to(x.dtype)

    fails(check_layernorm, layernorm_with(unchecked), "shape (2, 3, 1)", "validate.last_dim")


def test_half_precision_without_float32_inside_is_named():
    """float16 squares overflow above 256: a norm computed in the input's dtype fails, and the
    message says the check used a float16 input."""
    with pytest.raises(CheckFailure, match="float16 input") as info:
        check_layernorm(_layer_norm_in(upcast=False))
    assert "squaring overflows" in str(info.value)

    def rms_in_input_dtype(self, x):
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale) * self.w.to(x.dtype)

    with pytest.raises(CheckFailure, match="squaring overflows"):
        check_rmsnorm(rmsnorm_with(rms_in_input_dtype))


def test_half_precision_result_must_come_back_in_the_input_dtype():
    with pytest.raises(CheckFailure, match=r"expected a float16 output .* got torch.float32"):
        check_layernorm(_layer_norm_in(upcast=True, cast_back=False))


def test_eps_fixed_instead_of_self_eps_is_named():
    def fixed_eps(self, x):
        centred = x - x.mean(-1, keepdim=True)
        std = self.hook_scale((centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt())
        return self.hook_normalized(centred / std) * self.w + self.b

    with pytest.raises(CheckFailure, match="self.eps"):
        check_layernorm(layernorm_with(fixed_eps))


def test_a_failure_names_the_dtype_the_check_used():
    """The checker feeds float64; an implementation that always drops to float32 misses its
    tolerance, and the message says the check ran in float64."""

    def float32_always(self, x):
        y = x.float()
        centred = y - y.mean(-1, keepdim=True)
        std = self.hook_scale(centred.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt())
        return (self.hook_normalized(centred / std) * self.w.float() + self.b.float()).to(x.dtype)

    with pytest.raises(CheckFailure, match="float64 output"):
        check_layernorm(layernorm_with(float32_always))


def test_missing_or_misfed_hooks_are_named():
    def no_hooks(self, x):
        return torch.nn.functional.layer_norm(x, (self.d_model,), self.w, self.b, eps=self.eps)

    with pytest.raises(CheckFailure, match="hook_scale.*never received"):
        check_layernorm(layernorm_with(no_hooks))

    def normalized_after_affine(self, x):
        centred = x - x.mean(-1, keepdim=True)
        std = self.hook_scale((centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(centred / std * self.w + self.b)

    with pytest.raises(CheckFailure, match=r"hook_normalized(.|\n)*before w and b"):
        check_layernorm(layernorm_with(normalized_after_affine))

    def variance_to_hook_scale(self, x):
        centred = x - x.mean(-1, keepdim=True)
        variance = self.hook_scale(centred.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.hook_normalized(centred / variance.sqrt()) * self.w + self.b

    with pytest.raises(CheckFailure, match=r"hook_scale(.|\n)*standard deviation"):
        check_layernorm(layernorm_with(variance_to_hook_scale))

    def scale_without_keepdim(self, x):
        centred = x - x.mean(-1, keepdim=True)
        std = self.hook_scale((centred.pow(2).mean(-1) + self.eps).sqrt())
        return self.hook_normalized(centred / std[..., None]) * self.w + self.b

    with pytest.raises(CheckFailure, match=r"hook_scale`: expected shape \(2, 3, 1\)"):
        check_layernorm(layernorm_with(scale_without_keepdim))


def test_rmsnorm_hooks_fed_the_wrong_tensor_are_named():
    def normalized_after_w(self, x):
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale * self.w)

    with pytest.raises(CheckFailure, match=r"hook_normalized(.|\n)*before w"):
        check_rmsnorm(rmsnorm_with(normalized_after_w))

    def no_hooks(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt() * self.w

    with pytest.raises(CheckFailure, match="hook_scale.*never received"):
        check_rmsnorm(rmsnorm_with(no_hooks))


def test_one_pass_variance_fails_at_a_large_offset():
    def one_pass(self, x):
        mean = x.mean(-1, keepdim=True)
        std = self.hook_scale(((x * x).mean(-1, keepdim=True) - mean * mean + self.eps).sqrt())
        return self.hook_normalized((x - mean) / std) * self.w + self.b

    with pytest.raises(CheckFailure, match="two passes") as info:
        check_layernorm(layernorm_with(one_pass))
    assert "mean 10000" in str(info.value)


def test_blank_fails_with_its_hint():
    def forward(self, x):
        raise NotImplementedError("centre, divide by the std, scale and shift")

    with pytest.raises(CheckFailure, match="not implemented yet.*centre, divide by the std"):
        check_layernorm(layernorm_with(forward))
    with pytest.raises(CheckFailure, match="not implemented yet"):
        check_rmsnorm(rmsnorm_with(forward))


LAYERNORM_BUGS = {
    # bug name: (forward, a word the hint must contain)
    "variance with Bessel's correction": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True) + self.eps).sqrt() * self.w
            + self.b
        ),
        "Bessel",
    ),
    "eps outside the square root": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True))
            / (x.var(-1, keepdim=True, unbiased=False).sqrt() + self.eps)
            * self.w
            + self.b
        ),
        "inside the square root",
    ),
    "eps added to the std (x.std() + eps, as in the Annotated Transformer)": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps) * self.w + self.b
        ),
        "added to the std",
    ),
    "eps outside the square root as sqrt(var) + sqrt(eps)": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True))
            / (x.var(-1, keepdim=True, unbiased=False).sqrt() + self.eps**0.5)
            * self.w
            + self.b
        ),
        "outside the square root",
    ),
    "normalising over the wrong dim (positions)": (
        lambda self, x: (
            (x - x.mean(-2, keepdim=True))
            / (x.var(-2, keepdim=True, unbiased=False) + self.eps).sqrt()
            * self.w
            + self.b
        ),
        "dim -2",
    ),
    "normalising over the wrong dim (batch)": (
        lambda self, x: (
            (x - x.mean(0, keepdim=True))
            / (x.var(0, keepdim=True, unbiased=False) + self.eps).sqrt()
            * self.w
            + self.b
        ),
        "dim 0",
    ),
    "normalising over every dim": (
        lambda self, x: (
            (x - x.mean()) / (x.var(unbiased=False) + self.eps).sqrt() * self.w + self.b
        ),
        "every dim",
    ),
    "no learned scale and shift": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True))
            / (x.var(-1, keepdim=True, unbiased=False) + self.eps).sqrt()
        ),
        "shift b",
    ),
    "no eps at all": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True)) / x.var(-1, keepdim=True, unbiased=False).sqrt() * self.w
            + self.b
        ),
        "eps inside the square root",
    ),
    "w and b swapped": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True))
            / (x.var(-1, keepdim=True, unbiased=False) + self.eps).sqrt()
            * self.b
            + self.w
        ),
        "w and b are swapped",
    ),
}


@pytest.mark.parametrize("bug", list(LAYERNORM_BUGS))
def test_layernorm_bug_is_caught_with_targeted_hint(bug):
    forward, word = LAYERNORM_BUGS[bug]
    with pytest.raises(CheckFailure) as failure:
        check_layernorm(layernorm_with(forward))
    assert word in str(failure.value), str(failure.value)
    assert "Hint:" in str(failure.value)


RMSNORM_BUGS = {
    "subtracting the mean": (
        lambda self, x: (
            (x - x.mean(-1, keepdim=True))
            / (x.var(-1, keepdim=True, unbiased=False) + self.eps).sqrt()
            * self.w
        ),
        "does not subtract the mean",
    ),
    "eps outside the square root": (
        lambda self, x: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps) * self.w,
        "inside the square root",
    ),
    "normalising over the wrong dim": (
        lambda self, x: x / (x.pow(2).mean(-2, keepdim=True) + self.eps).sqrt() * self.w,
        "dim -2",
    ),
    "sum instead of mean": (
        lambda self, x: x / (x.pow(2).sum(-1, keepdim=True) + self.eps).sqrt() * self.w,
        "mean of x**2",
    ),
    "no eps at all": (
        lambda self, x: x / x.pow(2).mean(-1, keepdim=True).sqrt() * self.w,
        "NaN",
    ),
    "no learned scale": (
        lambda self, x: x / (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt(),
        "apply the learned scale w",
    ),
    "a fixed eps": (
        lambda self, x: x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * self.w,
        "use self.eps, not a fixed 1e-6",
    ),
}


@pytest.mark.parametrize("bug", list(RMSNORM_BUGS))
def test_rmsnorm_bug_is_caught_with_targeted_hint(bug):
    forward, word = RMSNORM_BUGS[bug]
    with pytest.raises(CheckFailure) as failure:
        check_rmsnorm(rmsnorm_with(forward))
    assert word in str(failure.value), str(failure.value)


def test_wrong_parameter_names_are_reported():
    class Renamed(torch.nn.Module):
        def __init__(self, d_model, eps=1e-5):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(d_model))
            self.bias = torch.nn.Parameter(torch.zeros(d_model))

    with pytest.raises(CheckFailure, match="TransformerLens names"):
        check_layernorm(Renamed)


def test_crash_in_learner_code_is_a_check_failure():
    def forward(self, x):
        return x @ torch.ones(3, 3)

    with pytest.raises(CheckFailure, match="raised RuntimeError"):
        check_layernorm(layernorm_with(forward))
