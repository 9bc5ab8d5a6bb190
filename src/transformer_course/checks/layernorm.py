"""Checkers for chapter 4's workbook (04_layernorm): a learner's `LayerNorm` and `RMSNorm`.

Each checker gives the learner's module random parameters and compares its output with
`F.layer_norm` / `F.rms_norm` in float64; a difference that a classic mistake explains
(unbiased variance, eps outside the square root, the wrong dimension, ...) is named.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_course import layernorm
from transformer_course.checks.harness import (
    call,
    expect,
    expect_close,
    expect_hooks,
    passed,
    perturb,
    randn,
)

D_MODEL = 4  # small, so dividing by d_model - 1 instead of d_model is a visible 4/3
BIG_EPS = 0.25  # large, so where eps goes changes the result visibly
SELF_EPS = "eps is a constructor argument: use self.eps, not a fixed {}."
HALF_HINT = (
    "in float16, squaring overflows once |x| > 256 (float16 ends at 65504): compute the "
    "statistics in float32 (`upcast(x)`) and return the result `.to(x.dtype)`."
)
WRONG_DIMS = {0: "dim 0 (the batch)", -2: "dim -2 (the positions)", None: "every dim at once"}


def _over(dim: int | None, x: Tensor) -> dict:
    return dict(dim=tuple(range(x.ndim)) if dim is None else dim, keepdim=True)


def _layer_norm_mistakes(x: Tensor, w: Tensor, b: Tensor, eps: float) -> dict[str, Tensor]:
    """The classic layer-norm bugs: {the hint naming each: the output it gives}."""
    c, affine = x - x.mean(-1, keepdim=True), lambda normalized: normalized * w + b
    var, unbiased = c.pow(2).mean(-1, keepdim=True), x.var(-1, keepdim=True)
    mistakes = {
        "the variance divides by d_model - 1 (Bessel's correction); layer norm uses the biased "
        "variance, x.var(-1, unbiased=False).": affine(c / (unbiased + eps).sqrt()),
        "is eps inside the square root? Divide by sqrt(var + eps).": affine(c / (var.sqrt() + eps)),
        "this looks like x.std(-1) + eps: eps is added to the std (it belongs inside the square "
        "root) and x.std is unbiased.": affine(c / (unbiased.sqrt() + eps)),
        "eps is added outside the square root: use sqrt(var + eps), not sqrt(var) + sqrt(eps).": (
            affine(c / (var.sqrt() + eps**0.5))
        ),
        "eps is missing: divide by sqrt(var + eps), with eps inside the square root, so a "
        "constant row gives b instead of 0/0.": affine(c / var.sqrt()),
        "did you apply the learned scale w and shift b? Return normalized * w + b.": (
            c / (var + eps).sqrt()
        ),
        SELF_EPS.format("1e-5"): affine(c / (var + 1e-5).sqrt()),
        "w and b are swapped: return normalized * w + b.": c / (var + eps).sqrt() * b + w,
    }
    for dim, where in WRONG_DIMS.items():
        wrong = x - x.mean(**_over(dim, x))
        wrong = wrong / (wrong.pow(2).mean(**_over(dim, x)) + eps).sqrt()
        mistakes[f"you normalise over {where}: take mean and variance over dim=-1."] = affine(wrong)
    return mistakes


def _rms_norm_mistakes(x: Tensor, w: Tensor, b: Tensor, eps: float) -> dict[str, Tensor]:
    """The classic RMSNorm bugs: {the hint naming each: the output it gives}."""
    mean_square, c = x.pow(2).mean(-1, keepdim=True), x - x.mean(-1, keepdim=True)
    mistakes = {
        "RMSNorm does not subtract the mean: divide x itself by sqrt(mean(x**2) + eps).": (
            c / (c.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w
        ),
        "is eps inside the square root? Divide by sqrt(mean(x**2) + eps).": (
            x / (mean_square.sqrt() + eps) * w
        ),
        "eps is missing: divide by sqrt(mean(x**2) + eps), with eps inside the square root, so an "
        "all-zero row gives 0 instead of NaN.": x / mean_square.sqrt() * w,
        "did you apply the learned scale w? Return normalized * w.": x / (mean_square + eps).sqrt(),
        "the root mean square uses the mean of x**2 over d_model, not the sum (or the norm).": (
            x / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt() * w
        ),
        SELF_EPS.format("1e-6"): x / (mean_square + 1e-6).sqrt() * w,
    }
    for dim, where in WRONG_DIMS.items():
        hint = f"you normalise over {where}: take the mean of x**2 over dim=-1."
        mistakes[hint] = x / (x.pow(2).mean(**_over(dim, x)) + eps).sqrt() * w
    return mistakes


def _build(name: str, cls: type, eps: float, params: tuple[str, ...], seed: int):
    """The learner's module in float64 with random parameters (so w=1, b=0 can't hide a bug)."""
    module = call(f"{name}.__init__", cls, D_MODEL, eps=eps)
    found = dict(module.named_parameters()) if isinstance(module, torch.nn.Module) else {}
    for param in params:
        shaped = param in found and tuple(found[param].shape) == (D_MODEL,)
        problem = f"expected a parameter `{param}` of shape ({D_MODEL},); found {sorted(found)}."
        hint = "keep the TransformerLens names: `w` (scale) and `b` (shift), created in __init__."
        expect(shaped, name, problem, hint)
    with torch.no_grad():
        for k, param in enumerate(params):
            found[param].copy_(randn(D_MODEL, seed=seed + k) + 1)
    return module.double()


def _check_norm(name: str, cls: type, reference: type, params: tuple, norm, mistakes, how: str):
    """What both norms must do: give `norm(x, w, b, eps)`, PyTorch's result, with two values of
    eps (a known mistake named); keep a constant row finite; feed their hook points. Returns the
    learner's module (float64, eps=BIG_EPS)."""
    for eps in (1e-5, BIG_EPS):
        module = _build(name, cls, eps, params, seed=int(eps * 100))
        w, b = module.w.detach(), getattr(module, "b", torch.zeros(1)).detach()
        scales = torch.tensor([1e-2, 0.3, 1.0, 3.0, 10.0], dtype=torch.float64)[:, None]
        for x in (randn(3, 5, D_MODEL, seed=3) * scales + 0.5, randn(2, 3, 2, D_MODEL, seed=2)):
            actual, wrong = call(f"{name}.forward", module, x), mistakes(x, w, b, eps)
            expected, where = norm(x, w, b, eps), f"{name}.forward"
            expect_close(actual, expected, where, how, atol=1e-6, rtol=1e-5, mistakes=wrong)
    constant = torch.stack([torch.zeros(D_MODEL), torch.full((D_MODEL,), 7.0)]).double()
    finite = bool(torch.isfinite(call(f"{name}.forward", module, constant)).all())
    hint = "a constant row has variance 0 (a zero row mean square 0): is eps inside the root?"
    expect(finite, f"{name}.forward (a constant row)", "gives NaN or inf.", hint)
    ours = reference(D_MODEL, eps=BIG_EPS).double()
    ours.load_state_dict(module.state_dict())
    what = "standard deviation" if "b" in params else "root mean square"
    hooks = {
        "hook_scale": f"pass the {what} each vector is divided by, shape (*batch, 1), through "
        "self.hook_scale.",
        "hook_normalized": f"pass the normalised vector, before {' and '.join(params)}, through "
        "self.hook_normalized.",
    }
    expect_hooks(name, module, ours, hooks, randn(2, 3, D_MODEL, seed=5) * 2 + 1)
    return module


def _check_half(name: str, cls: type, reference: type) -> None:
    """A float16 input in the hundreds: right only if the norm computes in float32, and the
    result must come back in float16."""
    module = perturb(call(f"{name}.__init__", cls, D_MODEL, eps=1e-5), seed=7)
    ours = reference(D_MODEL, eps=1e-5)
    ours.load_state_dict(module.state_dict())
    x, where = (
        (randn(3, 5, D_MODEL, seed=7) * 300).half(),
        f"{name} (float16 input in the hundreds)",
    )
    actual = call(f"{name}.forward", module, x)
    dtype, hint = (
        getattr(actual, "dtype", None),
        "compute in float32 inside, return `.to(x.dtype)`.",
    )
    expect(dtype == torch.float16, where, f"expected a float16 output (as x), got {dtype}.", hint)
    with torch.no_grad():
        expect_close(actual, ours(x), where, HALF_HINT, atol=1e-2, rtol=1e-2)


def check_layernorm(cls: type) -> None:
    """`LayerNorm(d_model, eps)`: parameters `w`, `b`; forward normalises over the last dim."""
    name, how = "LayerNorm", "subtract the mean, divide by sqrt(biased variance + eps), * w + b."
    norm = lambda x, w, b, eps: F.layer_norm(x, (D_MODEL,), w, b, eps=eps)
    mistakes = _layer_norm_mistakes
    module = _check_norm(name, cls, layernorm.LayerNorm, ("w", "b"), norm, mistakes, how)
    constant, b = torch.full((2, D_MODEL), 7.0, dtype=torch.float64), module.b.detach()
    actual, where = call(f"{name}.forward", module, constant), f"{name}.forward (a constant row)"
    expect_close(actual, b.expand(2, D_MODEL), where, "a constant row comes out as b.", atol=1e-6)
    module = call(f"{name}.__init__", cls, D_MODEL, eps=1e-5)
    x = 1e4 + randn(4, D_MODEL, seed=6, dtype=torch.float32)
    expected = norm(x.double(), module.w.double(), module.b.double(), 1e-5).float()
    hint = "compute the variance as the mean of squared deviations from the mean (two passes); "
    hint += "mean(x**2) - mean(x)**2 cancels catastrophically when the mean is large."
    actual, where = call(f"{name}.forward", module, x), f"{name} (float32 input with mean 10000)"
    expect_close(actual, expected, where, hint, atol=1e-2, rtol=1e-2)
    _check_half(name, cls, layernorm.LayerNorm)
    passed(name)


def check_rmsnorm(cls: type) -> None:
    """`RMSNorm(d_model, eps)`: parameter `w` only; x / sqrt(mean(x**2) + eps) * w."""
    name, how = "RMSNorm", "divide x by sqrt(mean(x**2, dim=-1) + eps), then scale by w."
    norm = lambda x, w, b, eps: F.rms_norm(x, (D_MODEL,), w, eps=eps)
    module = _check_norm(name, cls, layernorm.RMSNorm, ("w",), norm, _rms_norm_mistakes, how)
    no_b = "b" not in dict(module.named_parameters())
    expect(no_b, name, "RMSNorm has no shift `b`, only the scale `w`.")
    _check_half(name, cls, layernorm.RMSNorm)
    passed(name)
