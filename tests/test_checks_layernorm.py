"""The chapter 4 checkers accept the reference and reject each classic bug with a targeted hint."""

from __future__ import annotations

import pytest
import torch

from transformer_course.checks import CheckFailure
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


def test_torch_module_under_our_names_passes():
    """An independent correct implementation (PyTorch's) passes too: the checker is not ours-only."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, (self.d_model,), self.w, self.b, eps=self.eps)

    check_layernorm(layernorm_with(forward))


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
        lambda self, x: (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True) + self.eps).sqrt() * self.w + self.b,
        "Bessel",
    ),
    "eps outside the square root": (
        lambda self, x: (x - x.mean(-1, keepdim=True))
        / (x.var(-1, keepdim=True, unbiased=False).sqrt() + self.eps)
        * self.w
        + self.b,
        "inside the square root",
    ),
    "eps added to the std (x.std() + eps, as in the Annotated Transformer)": (
        lambda self, x: (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps) * self.w + self.b,
        "added to the std",
    ),
    "eps outside the square root as sqrt(var) + sqrt(eps)": (
        lambda self, x: (x - x.mean(-1, keepdim=True))
        / (x.var(-1, keepdim=True, unbiased=False).sqrt() + self.eps**0.5)
        * self.w
        + self.b,
        "outside the square root",
    ),
    "normalising over the wrong dim (positions)": (
        lambda self, x: (x - x.mean(-2, keepdim=True))
        / (x.var(-2, keepdim=True, unbiased=False) + self.eps).sqrt()
        * self.w
        + self.b,
        "dim -2",
    ),
    "normalising over the wrong dim (batch)": (
        lambda self, x: (x - x.mean(0, keepdim=True))
        / (x.var(0, keepdim=True, unbiased=False) + self.eps).sqrt()
        * self.w
        + self.b,
        "dim 0",
    ),
    "normalising over every dim": (
        lambda self, x: (x - x.mean()) / (x.var(unbiased=False) + self.eps).sqrt() * self.w + self.b,
        "every dim",
    ),
    "no learned scale and shift": (
        lambda self, x: (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True, unbiased=False) + self.eps).sqrt(),
        "shift b",
    ),
    "no eps at all": (
        lambda self, x: (x - x.mean(-1, keepdim=True)) / x.var(-1, keepdim=True, unbiased=False).sqrt() * self.w + self.b,
        "eps inside the square root",
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
        lambda self, x: (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True, unbiased=False) + self.eps).sqrt() * self.w,
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
