"""Checkers for chapter 4: a learner's `LayerNorm` and `RMSNorm` classes.

Each checker builds the learner's module, gives it random `w` and `b`, and compares its output
with `torch.nn.functional.layer_norm` / `rms_norm` in float64. When they differ, it compares the
output with the classic mistakes (unbiased variance, eps outside the square root, the wrong
dimension, ...) and names the one that matches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_course import layernorm
from transformer_course.checks import call, expect, expect_close, expect_hooks, passed

__all__ = ["check_layernorm", "check_rmsnorm"]

D_MODEL = 4  # small, so dividing by d_model - 1 instead of d_model is a visible 4/3
BIG_EPS = 0.25  # large, so where eps goes changes the result visibly
LAYERNORM_HINT = (
    "subtract the mean over the last dim, divide by sqrt(biased variance + eps), then * w + b."
)
RMSNORM_HINT = "divide x by sqrt(mean(x**2, dim=-1) + eps), then scale by w."


def _inputs(generator: torch.Generator) -> list[Tensor]:
    """Batched inputs with rows of very different scales (where eps placement shows)."""
    x = torch.randn(3, 5, D_MODEL, generator=generator, dtype=torch.float64)
    scales = torch.tensor([1e-2, 0.3, 1.0, 3.0, 10.0], dtype=torch.float64)[None, :, None]
    return [
        x * scales + 0.5,
        torch.randn(2, 3, 2, D_MODEL, generator=generator, dtype=torch.float64),
    ]


def _center(x: Tensor, dim) -> Tensor:
    return x - x.mean(dim=dim, keepdim=True)


WRONG_DIMS = ((0, "dim 0 (the batch)"), (-2, "dim -2 (the positions)"), (None, "every dim at once"))


def _layer_norm_mistakes(x: Tensor, w: Tensor, b: Tensor, eps: float) -> list[tuple[Tensor, str]]:
    """The classic layer-norm bugs, each as the output it would give and the hint it deserves."""
    centred = _center(x, -1)
    biased = centred.pow(2).mean(-1, keepdim=True)
    unbiased = x.var(-1, keepdim=True, unbiased=True)

    def affine(normalized: Tensor) -> Tensor:
        return normalized * w + b

    mistakes = [
        (
            affine(centred / (unbiased + eps).sqrt()),
            "the variance divides by d_model - 1 (Bessel's correction); layer norm uses the "
            "biased variance: mean of squared deviations, i.e. x.var(-1, unbiased=False).",
        ),
        (
            affine(centred / (biased.sqrt() + eps)),
            "is eps inside the square root? Divide by sqrt(var + eps), not sqrt(var) + eps.",
        ),
        (
            affine(centred / (unbiased.sqrt() + eps)),
            "this looks like x.std(-1) + eps: eps is added to the std (it belongs inside the "
            "square root) and x.std is unbiased by default (layer norm divides by d_model, not "
            "d_model - 1).",
        ),
        (
            affine(centred / (biased.sqrt() + eps**0.5)),
            "eps is added outside the square root: use sqrt(var + eps), not sqrt(var) + sqrt(eps).",
        ),
        (
            affine(centred / biased.sqrt()),
            "eps is missing: divide by sqrt(var + eps), with eps inside the square root, so a "
            "constant row gives b instead of 0/0.",
        ),
        (
            centred / (biased + eps).sqrt(),
            "did you apply the learned scale w and shift b? Return normalized * w + b.",
        ),
        (
            affine(centred / (biased + 1e-5).sqrt()),
            "eps is a constructor argument: use self.eps, not a fixed 1e-5.",
        ),
        (
            centred / (biased + eps).sqrt() * b + w,
            "w and b are swapped: return normalized * w + b.",
        ),
    ]
    for dim, where in WRONG_DIMS:
        dims = tuple(range(x.ndim)) if dim is None else dim
        wrong = _center(x, dims) / (_center(x, dims).pow(2).mean(dims, keepdim=True) + eps).sqrt()
        hint = (
            f"you normalise over {where}: take mean and variance over the last dim, dim=-1 with "
            "keepdim=True, so each position is normalised on its own."
        )
        mistakes.append((affine(wrong), hint))
    return mistakes


def _rms_norm_mistakes(x: Tensor, w: Tensor, eps: float) -> list[tuple[Tensor, str]]:
    """The classic RMSNorm bugs, each as the output it would give and the hint it deserves."""
    mean_square = x.pow(2).mean(-1, keepdim=True)
    centred = _center(x, -1)
    mistakes = [
        (
            centred / (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w,
            "RMSNorm does not subtract the mean: divide x itself by sqrt(mean(x**2) + eps).",
        ),
        (
            x / (mean_square.sqrt() + eps) * w,
            "is eps inside the square root? Divide by sqrt(mean(x**2) + eps), not "
            "sqrt(mean(x**2)) + eps.",
        ),
        (
            x / mean_square.sqrt() * w,
            "eps is missing: divide by sqrt(mean(x**2) + eps), with eps inside the square root, "
            "so an all-zero row gives 0 instead of NaN.",
        ),
        (
            x / (mean_square + eps).sqrt(),
            "did you apply the learned scale w? Return normalized * w.",
        ),
        (
            x / (x.pow(2).sum(-1, keepdim=True) + eps).sqrt() * w,
            "the root mean square uses the mean of x**2 over d_model, not the sum (or the norm).",
        ),
        (
            x / (mean_square + 1e-6).sqrt() * w,
            "eps is a constructor argument: use self.eps, not a fixed 1e-6.",
        ),
    ]
    for dim, where in WRONG_DIMS:
        dims = tuple(range(x.ndim)) if dim is None else dim
        hint = (
            f"you normalise over {where}: take the mean of x**2 over the last dim, dim=-1 with "
            "keepdim=True."
        )
        mistakes.append((x / (x.pow(2).mean(dims, keepdim=True) + eps).sqrt() * w, hint))
    return mistakes


def _hint_for_known_mistake(
    actual: Tensor, mistakes: list[tuple[Tensor, str]], fallback: str
) -> str:
    """The hint of the first mistake whose output matches `actual`, else `fallback`."""
    if isinstance(actual, Tensor) and not torch.isnan(actual).any():
        for wrong, hint in mistakes:
            matches = actual.shape == wrong.shape and torch.allclose(
                actual.detach().double(), wrong, atol=1e-6, rtol=1e-5
            )
            if matches:
                return hint
    return fallback


def _build(
    name: str, cls: Callable, eps: float, param_names: tuple[str, ...], generator: torch.Generator
):
    """The learner's module in float64 with random parameters (so w=1, b=0 can't hide a bug)."""
    module = call(f"{name}.__init__", cls, D_MODEL, eps=eps)
    expect(
        isinstance(module, torch.nn.Module),
        name,
        f"expected an nn.Module, got {type(module).__name__}.",
    )
    params = dict(module.named_parameters())
    for param in param_names:
        expect(
            param in params and tuple(params[param].shape) == (D_MODEL,),
            name,
            f"expected a parameter `{param}` of shape ({D_MODEL},); found "
            f"{sorted(params) or 'no parameters'}.",
            "keep the TransformerLens names: `w` (scale) and `b` (shift), created in __init__.",
        )
    module = module.double()
    with torch.no_grad():
        for param in param_names:
            params[param].copy_(torch.randn(D_MODEL, generator=generator, dtype=torch.float64) + 1)
    return module


def _expect_no_nan_on_constant_rows(name: str, module: torch.nn.Module, hint: str) -> Tensor:
    constant = torch.stack([torch.zeros(D_MODEL), torch.full((D_MODEL,), 7.0)]).double()
    out = call(f"{name}.forward", module, constant)
    expect(isinstance(out, Tensor), name, f"expected a torch.Tensor, got {type(out).__name__}.")
    expect(bool(torch.isfinite(out).all()), name, "a row of equal values gives NaN or inf.", hint)
    return out


SCALE_HOOK_HINT = (
    "pass the {what} each vector is divided by, shape (*batch, 1), through self.hook_scale."
)
NORMALIZED_HOOK_HINT = "pass the normalised vector, before {what}, through self.hook_normalized."
OFFSET = 1e4  # a large mean: the one-pass variance mean(x**2) - mean(x)**2 loses all precision


def _expect_hooks(
    name: str, module: torch.nn.Module, reference: torch.nn.Module, what: str, after: str
) -> None:
    x = (
        torch.randn(2, 3, D_MODEL, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        * 2
        + 1
    )
    reference = reference.double()
    reference.load_state_dict(module.state_dict())
    expect_hooks(
        name,
        module,
        reference,
        {
            "hook_scale": SCALE_HOOK_HINT.format(what=what),
            "hook_normalized": NORMALIZED_HOOK_HINT.format(what=after),
        },
        x,
    )


def _expect_stable_at_large_offset(
    name: str, cls: Callable, reference: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> None:
    """In float32, a mean of 1e4 must not wreck the result (a one-pass variance does)."""
    module = call(f"{name}.__init__", cls, D_MODEL, eps=1e-5)
    x = OFFSET + torch.randn(4, D_MODEL, generator=torch.Generator().manual_seed(6))
    actual = call(f"{name}.forward", module, x)
    expected = reference(x.double(), module.w.detach().double(), getattr(module, "b", None))
    expect_close(
        actual.double() if isinstance(actual, Tensor) else actual,
        expected,
        f"{name} (float32 input with mean {OFFSET:g})",
        "compute the variance as the mean of squared deviations from the mean (two passes); "
        "mean(x**2) - mean(x)**2 cancels catastrophically when the mean is large.",
        atol=1e-2,
        rtol=1e-2,
    )


HALF_HINT = (
    "in float16, squaring overflows once |x| > 256 (float16 ends at 65504): compute the "
    "statistics in float32 (`upcast(x)`) and return the result `.to(x.dtype)`."
)


def _expect_half_precision(name: str, cls: Callable, reference: torch.nn.Module) -> None:
    """A float16 input in the hundreds: right only if the norm computes in float32, and the
    result must come back in float16."""
    g = torch.Generator().manual_seed(7)
    module = call(f"{name}.__init__", cls, D_MODEL, eps=reference.eps)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.5 + 1)
    reference.load_state_dict(module.state_dict())
    x = (torch.randn(3, 5, D_MODEL, generator=g) * 300).half()
    where = f"{name} (float16 input with values in the hundreds)"
    actual = call(f"{name}.forward", module, x)
    dtype = getattr(actual, "dtype", type(actual).__name__)
    expect(
        dtype == torch.float16,
        where,
        f"expected a float16 output (the input's dtype), got {dtype}.",
        "computing in float32 inside is right; return the result `.to(x.dtype)`.",
    )
    with torch.no_grad():
        expected = reference(x)
    expect_close(actual, expected, where, HALF_HINT, atol=1e-2, rtol=1e-2)


def check_layernorm(cls: Callable) -> None:
    """Check a `LayerNorm(d_model, eps)` class: parameters `w`, `b`; forward over the last dim."""
    generator = torch.Generator().manual_seed(0)
    for eps in (1e-5, BIG_EPS):
        ln = _build("LayerNorm", cls, eps, ("w", "b"), generator)
        w, b = ln.w.detach(), ln.b.detach()
        for x in _inputs(generator):
            actual = call("LayerNorm.forward", ln, x)
            expected = F.layer_norm(x, (D_MODEL,), w, b, eps=eps)
            hint = _hint_for_known_mistake(
                actual, _layer_norm_mistakes(x, w, b, eps), LAYERNORM_HINT
            )
            expect_close(actual, expected, "LayerNorm.forward", hint, atol=1e-6, rtol=1e-5)
    out = _expect_no_nan_on_constant_rows(
        "LayerNorm.forward",
        ln,
        "a constant row has variance 0: is eps inside the square root, sqrt(var + eps)?",
    )
    expect_close(
        out,
        b.expand(2, D_MODEL),
        "LayerNorm.forward",
        "a constant row should come out as b.",
        atol=1e-6,
    )
    _expect_hooks(
        "LayerNorm", ln, layernorm.LayerNorm(D_MODEL, eps=BIG_EPS), "standard deviation", "w and b"
    )
    _expect_stable_at_large_offset(
        "LayerNorm",
        cls,
        lambda x, w, b: F.layer_norm(
            x, (D_MODEL,), w, b.double() if b is not None else None, eps=1e-5
        ),
    )
    _expect_half_precision("LayerNorm", cls, layernorm.LayerNorm(D_MODEL, eps=1e-5))
    passed("LayerNorm")


def check_rmsnorm(cls: Callable) -> None:
    """Check an `RMSNorm(d_model, eps)` class: parameter `w`; x / sqrt(mean(x**2) + eps) * w."""
    generator = torch.Generator().manual_seed(1)
    for eps in (1e-6, BIG_EPS):
        norm = _build("RMSNorm", cls, eps, ("w",), generator)
        expect(
            "b" not in dict(norm.named_parameters()),
            "RMSNorm",
            "RMSNorm has no shift `b`, only the scale `w`.",
        )
        w = norm.w.detach()
        for x in _inputs(generator):
            actual = call("RMSNorm.forward", norm, x)
            expected = F.rms_norm(x, (D_MODEL,), w, eps=eps)
            hint = _hint_for_known_mistake(actual, _rms_norm_mistakes(x, w, eps), RMSNORM_HINT)
            expect_close(actual, expected, "RMSNorm.forward", hint, atol=1e-6, rtol=1e-5)
    _expect_no_nan_on_constant_rows(
        "RMSNorm.forward",
        norm,
        "an all-zero row must not give NaN: add eps inside the square root.",
    )
    _expect_hooks("RMSNorm", norm, layernorm.RMSNorm(D_MODEL, eps=BIG_EPS), "root mean square", "w")
    _expect_half_precision("RMSNorm", cls, layernorm.RMSNorm(D_MODEL, eps=1e-6))
    passed("RMSNorm")
