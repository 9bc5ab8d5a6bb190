"""Checkers for chapter 4's workbook (04_layernorm): `LayerNorm` and `RMSNorm`, with random
parameters, against `F.layer_norm` / `F.rms_norm` in float64, a classic mistake named."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from transformer_course import layernorm
from transformer_course.checks.harness import (
    build_module,
    call,
    expect,
    expect_close,
    expect_hooks,
    expect_raises,
    passed,
    perturb,
    randn,
)

D_MODEL = 4  # small, so dividing by d_model - 1 instead of d_model is a visible 4/3
BIG_EPS = 0.25  # large, so where eps goes changes the result visibly
SELF_EPS = "eps is a constructor argument: use self.eps, not a fixed {}."
HALF_HINT = "in float16, squaring overflows once |x| > 256 (float16 ends at 65504): compute the "
HALF_HINT += "statistics in float32 (`upcast(x)`) and return the result `.to(x.dtype)`."
WRONG_DIMS = {"dim 0 (the batch)": 0, "dim -2 (the positions)": -2, "every dim at once": None}
LAYER_NORM_MISTAKES = {  # the hint: what is wrong, as keywords of `_norm`
    "the variance divides by d_model - 1 (Bessel's correction); layer norm uses the biased "
    "variance, x.var(-1, unbiased=False).": dict(correction=1),
    "is eps inside the square root? Divide by sqrt(var + eps).": dict(eps_at="out"),
    "this looks like x.std(-1) + eps: eps is added to the std (it belongs inside the square "
    "root) and x.std is unbiased.": dict(correction=1, eps_at="out"),
    "eps is added outside the square root: sqrt(var + eps), not sqrt(var) + sqrt(eps).": (
        dict(eps_at="root")
    ),
    "eps is missing: divide by sqrt(var + eps), with eps inside the square root, so a constant "
    "row gives b instead of 0/0.": dict(eps_at="none"),
    "did you apply the learned scale w and shift b? Return normalized * w + b.": dict(affine=""),
    SELF_EPS.format("1e-5"): dict(eps=1e-5),
    "w and b are swapped: return normalized * w + b.": dict(affine="swapped"),
}
RMS_NORM_MISTAKES = {
    "RMSNorm does not subtract the mean: divide x itself by sqrt(mean(x**2) + eps).": dict(
        centre=True
    ),
    "is eps inside the square root? Divide by sqrt(mean(x**2) + eps).": dict(eps_at="out"),
    "eps is missing: divide by sqrt(mean(x**2) + eps), with eps inside the square root, so an "
    "all-zero row gives 0 instead of NaN.": dict(eps_at="none"),
    "did you apply the learned scale w? Return normalized * w.": dict(affine=""),
    "the root mean square uses the mean of x**2 over d_model, not the sum.": dict(reduce="sum"),
    SELF_EPS.format("1e-6"): dict(eps=1e-6),
}
DIM_MISTAKES = {
    f"you normalise over {where}: take the statistics over the last dim, dim=-1.": dict(dim=dim)
    for where, dim in WRONG_DIMS.items()
}


def _norm(x, w, b, eps, centre, dim=-1, correction=0, reduce="mean", eps_at="in", affine="wb"):
    """Layer norm (`centre`) or RMSNorm (b = 0) of `x`, with the knobs a mistake turns."""
    over = dict(dim=tuple(range(x.ndim)) if dim is None else dim, keepdim=True)
    c = x - x.mean(**over) if centre else x
    square = c.pow(2).sum(**over)
    if reduce == "mean":
        square = square / (x.numel() // square.numel() - correction)
    eps_root = dict(out=square.sqrt() + eps, root=square.sqrt() + eps**0.5, none=square.sqrt())
    y = c / eps_root.get(eps_at, (square + eps).sqrt())
    return {"": y, "swapped": y * b + w}.get(affine, y * w + b)


def _build(name: str, cls: type, eps: float, params: tuple[str, ...], seed: int):
    """The learner's module in float64 with random parameters (so w=1, b=0 can't hide a bug)."""
    module = build_module(name, cls, D_MODEL, eps=eps, params={p: (D_MODEL,) for p in params})
    with torch.no_grad():
        for k, param in enumerate(params):
            getattr(module, param).copy_(randn(D_MODEL, seed=seed + k) + 1)
    return module.double()


def _check_norm(name: str, cls: type, centre: bool) -> None:
    """Layer norm (`centre`) or RMSNorm against PyTorch's, hooks, float16."""
    params, reference = ("w", "b") if centre else ("w",), getattr(layernorm, name)
    norm = lambda x, w, b, eps: (
        F.layer_norm(x, (D_MODEL,), w, b, eps) if centre else F.rms_norm(x, (D_MODEL,), w, eps)
    )
    how = "subtract the mean, divide by sqrt(biased variance + eps), * w + b."
    how = how if centre else "divide x by sqrt(mean(x**2, dim=-1) + eps), then scale by w."
    table = {**(LAYER_NORM_MISTAKES if centre else RMS_NORM_MISTAKES), **DIM_MISTAKES}.items()
    for eps in (1e-5, BIG_EPS):
        module = _build(name, cls, eps, params, seed=int(eps * 100))
        w, b = module.w.detach(), getattr(module, "b", torch.zeros(1)).detach()
        scales = torch.tensor([1e-2, 0.3, 1.0, 3.0, 10.0], dtype=torch.float64)[:, None]
        for x in (randn(3, 5, D_MODEL, seed=3) * scales + 0.5, randn(2, 3, 2, D_MODEL, seed=2)):
            wrong = {h: _norm(x, w, b, **{"eps": eps, "centre": centre, **k}) for h, k in table}
            actual, where, expected = call(f"{name}.forward", module, x), name, norm(x, w, b, eps)
            expect_close(actual, expected, where, how, atol=1e-6, rtol=1e-5, mistakes=wrong)
    (ours := reference(D_MODEL, eps=BIG_EPS).double()).load_state_dict(module.state_dict())
    what = "standard deviation" if centre else "root mean square"
    hooks = {"hook_scale": f"the {what} each vector is divided by, shape (*batch, 1),"}
    hooks["hook_normalized"] = f"the normalised vector, before {' and '.join(params)},"
    hooks = {hook: f"pass {what} through self.{hook}." for hook, what in hooks.items()}
    expect_hooks(name, module, ours, hooks, randn(2, 3, D_MODEL, seed=5) * 2 + 1)
    if centre:
        constant, b = torch.full((2, D_MODEL), 7.0, dtype=torch.float64), module.b.detach()
        actual, where = call(f"{name}.forward", module, constant), f"{name} (a constant row)"
        expect_close(actual, b.expand(2, D_MODEL), where, "a constant row comes out as b.")
        module = call(f"{name}.__init__", cls, D_MODEL, eps=1e-5)
        x = 1e4 + randn(4, D_MODEL, seed=6, dtype=torch.float32)
        expected = norm(x.double(), module.w.double(), module.b.double(), 1e-5).float()
        hint = "compute the variance as the mean of squared deviations from the mean (two "
        hint += "passes); mean(x**2) - mean(x)**2 cancels catastrophically for a large mean."
        actual, where = call(f"{name}.forward", module, x), f"{name} (float32 input, mean 10000)"
        expect_close(actual, expected, where, hint, atol=1e-2, rtol=1e-2)
    _check_half(name, cls, reference, table)
    _check_refuses(name, cls)
    passed(name)


def _check_half(name: str, cls: type, reference: type, table) -> None:
    """float16 and bfloat16 inputs, near 300 (squares overflow float16) and near 0.5 with a
    large eps (where eps goes shows): the input's dtype out, the reference's values."""
    for dtype, tol in ((torch.float16, 1e-2), (torch.bfloat16, 2e-2)):
        for eps, scale in ((1e-5, 300.0), (BIG_EPS, 0.5)):
            module = perturb(call(f"{name}.__init__", cls, D_MODEL, eps=eps), seed=7)
            (ours := reference(D_MODEL, eps=eps)).load_state_dict(module.state_dict())
            x = (randn(3, 5, D_MODEL, seed=7) * scale).to(dtype)
            where = f"{name}(eps={eps}) ({str(dtype)[6:]} input of scale {scale:g})"
            hint = "compute in float32, return `.to(x.dtype)`."
            actual = call(f"{name}.forward", module, x)
            got = getattr(actual, "dtype", None)
            problem = f"expected a {str(dtype)[6:]} output (as x), got {got}."
            expect(got == dtype, where, problem, hint)
            w, b = module.w.detach().double(), getattr(module, "b", torch.zeros(1)).detach()
            exact = dict(eps=eps, centre=name == "LayerNorm")
            wrong = {h: _norm(x.double(), w, b.double(), **{**exact, **k}) for h, k in table}
            expected = ours(x).detach()
            expect_close(actual, expected, where, HALF_HINT, atol=tol, rtol=tol, mistakes=wrong)


LAST_DIM_HINT = "an input whose last dim is not d_model must be refused with a ValueError "
LAST_DIM_HINT += 'that says so: start with validate.last_dim("x", x, self.d_model), given.'


def _check_refuses(name: str, cls: type) -> None:
    """An input whose last dim is not `d_model` is refused, also one of size 1, which
    broadcasts against `w` and `b` into a wrong result instead of failing."""
    module = call(f"{name}.__init__", cls, D_MODEL)
    for shape in ((2, 3, 1), (2, D_MODEL + 1)):
        x, where = torch.ones(shape), f"{name}(d_model={D_MODEL}) on an input of shape {shape}"
        expect_raises(where, LAST_DIM_HINT, module, x, errors=(ValueError,))


def check_layernorm(cls: type) -> None:
    """`LayerNorm(d_model, eps)`: parameters `w`, `b`; normalises over the last dim."""
    _check_norm("LayerNorm", cls, centre=True)


def check_rmsnorm(cls: type) -> None:
    """`RMSNorm(d_model, eps)`: parameter `w` only; x / sqrt(mean(x**2) + eps) * w."""
    _check_norm("RMSNorm", cls, centre=False)
