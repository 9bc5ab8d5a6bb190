"""What every checker is built from: run the learner's code, compare it with the reference, and
name the likely mistake, one way everywhere: a table {hint: the output that mistake gives}."""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from transformer_course.attention import LayerCache

CHECKERS = Path(__file__).resolve().parent
CONVENTION_HINT = "True means *may attend* (PyTorch's convention): keep the scores where the "
CONVENTION_HINT += "mask is True and fill the ones where it is False (`~mask`)."
OVERFLOW_HINT = "exp overflows for large scores (above 88 in float32): subtract each row's "
OVERFLOW_HINT += "maximum before exp, as `torch.softmax` does (a constant shift changes nothing)."
EVAL_HINT = "`with evaluating(model):` sets eval mode and no_grad, and restores the mode after."


class CheckFailure(AssertionError):
    """An exercise check failed; the message says what went wrong and hints at why."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the message and the learner's frames that raised."""
        lines = f"CheckFailure: {self}".splitlines()
        cause = self.__cause__
        if cause is not None:
            theirs = lambda frame: not Path(frame.filename).resolve().is_relative_to(CHECKERS)
            frames = list(filter(theirs, traceback.extract_tb(cause.__traceback__)))
            lines += ["", "Where your code raised it:"]
            lines += "".join(traceback.format_list(frames)).rstrip("\n").splitlines()
            lines += traceback.format_exception_only(type(cause), cause)[-1:]
        return [line.rstrip("\n") for line in lines]


def call(name: str, fn: Callable[..., Any], *args: Any, hint: str = "", **kwargs: Any) -> Any:
    """Call the learner's `fn`; a blank or a crash (with `hint`) becomes a `CheckFailure`."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        which = f" ({exc})" if str(exc) else ""
        raise CheckFailure(f"`{name}` is not implemented yet{which}.") from None
    except Exception as exc:  # the learner's code crashed: say where, keep the cause
        message = f"`{name}` raised {type(exc).__name__}: {exc}"
        raise CheckFailure(message + (f"\nHint: {hint}" if hint else "")) from exc


def expect(condition: Any, name: str, problem: str, hint: str = "") -> None:
    """Fail with `problem` (and `hint`) unless `condition` holds."""
    if not condition:
        raise CheckFailure(f"`{name}`: {problem}" + (f"\nHint: {hint}" if hint else ""))


def expect_raises(name: str, hint: str, fn: Callable, *args: Any, errors=(Exception,)) -> None:
    """The learner's `fn(*args)` must refuse its input with one of `errors`."""
    try:
        result = fn(*args)
    except errors:
        return
    except Exception as exc:
        raise CheckFailure(f"`{name}` raised {type(exc).__name__}: {exc}\nHint: {hint}") from exc
    expect(False, name, f"accepted, returning {describe(result)}.", hint)


def expect_unchanged(name: str, given: Tensor, original: Tensor) -> None:
    """The learner's function left the tensor it was `given` (a copy of `original`) as it was."""
    hint = "compute a new tensor (x * y, not x.mul_(y) or x *= y): the caller still needs x."
    expect(torch.equal(given, original), name, "it changed its input x in place.", hint)


def describe(value: Any, width: int = 200) -> str:
    """A short description of a value, for a message: a long list or dict shows its first
    entries, whole, and how many there are (never an entry cut in the middle)."""
    if isinstance(value, Tensor):
        return f"a {str(value.dtype)[6:]} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    if len(text) <= width or not isinstance(value, (list, tuple, dict)):
        return text if len(text) <= width else text[: width - 3] + "..."
    part = max(width // 2, 40)  # a long entry is itself shortened, whole entries first
    if isinstance(value, dict):
        items = [f"{k!r}: {describe(v, part)}" for k, v in value.items()]
    else:
        items = [describe(item, part) for item in value]
    shown = 0
    while shown < len(items) and sum(len(i) + 2 for i in items[: shown + 1]) < width - 30:
        shown += 1
    ends = {dict: "{}", tuple: "()"}.get(type(value), "[]")
    if shown == len(items):
        return f"{ends[0]}{', '.join(items)}{ends[1]}"
    head = "".join(f"{item}, " for item in items[: max(shown, 1)])
    return f"{ends[0]}{head}...{ends[1]} ({len(items)} entries)"


def shape_of(value: Any) -> tuple | str:
    """The shape of a tensor, or what else `value` is."""
    return tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__


def matches(actual: Any, wanted: Any, atol: float = 1e-6) -> bool:
    """Whether `actual` is `wanted`: tensors within `atol`, floats within 1e-6, else equal."""
    if isinstance(wanted, Tensor):
        if shape_of(actual) != tuple(wanted.shape):
            return False
        if not wanted.is_floating_point():
            return torch.equal(actual.detach().to(wanted.dtype), wanted)
        return torch.allclose(actual.detach().double(), wanted.detach().double(), atol=atol)
    if isinstance(wanted, float) and isinstance(actual, (int, float)):
        return math.isclose(actual, wanted, rel_tol=1e-6)
    return isinstance(actual, type(wanted)) and actual == wanted


def distance(actual: Any, wanted: Any) -> float:
    """How far `actual` is from `wanted`, of which it `matches` (0 where that means equal)."""
    if isinstance(wanted, Tensor) and wanted.is_floating_point() and wanted.numel():
        return float((actual.detach().double() - wanted.detach().double()).abs().max())
    return abs(actual - wanted) if isinstance(wanted, float) else 0.0


def expect_no_known_mistake(name: str, actual, mistakes: Mapping, *, atol=1e-6, problem=""):
    """Fail with the hint of the mistake ({hint: its output}) that `actual` is, if any: of
    several within `atol`, the closest."""
    near = {h: distance(actual, w) for h, w in mistakes.items() if matches(actual, w, atol)}
    hint = min(near, key=near.get, default=None)
    expect(hint is None, name, problem or "values differ from the reference.", hint or "")


def expect_close(actual, expected, name: str, hint="", *, atol=1e-5, rtol=1e-4, mistakes=None):
    """Type, shape, no NaN, values within `atol` + `rtol`; a known mistake named."""
    problem = f"expected {describe(expected)}, got {describe(actual)}."
    if isinstance(expected, Tensor):
        expect(isinstance(actual, Tensor), name, problem)
        shape, got = tuple(expected.shape), tuple(actual.shape)
        expect(got == shape, name, f"expected shape {shape}, got {got}.", shape_hint(got, shape))
        expect(not torch.isnan(actual).any(), name, "the result contains NaN.", hint)
        dtype, actual = actual.dtype, actual.detach().to(expected.dtype)
        if torch.allclose(actual, expected, atol=atol, rtol=rtol):
            return
        problem = f"values differ from the reference ({_gap(actual, expected)}; "
        problem += f"{str(dtype)[6:]} output of shape {shape})."
        expect_no_known_mistake(name, actual, mistakes or {}, atol=atol, problem=problem)
        expect(not _rounded(actual, expected), name, problem, PRECISION_HINT)
        expect(False, name, problem, hint)
    elif matches(actual, expected):
        return
    expect_no_known_mistake(name, actual, mistakes or {}, atol=atol, problem=problem)
    expect(False, name, problem, hint)


def shape_hint(got: tuple, wanted: tuple) -> str:
    """What a shape that differs from the `wanted` one suggests."""
    if len(got) < len(wanted) and wanted[len(wanted) - len(got) :] == got:
        missing = wanted[: len(wanted) - len(got)]
        return f"the leading dims {missing} are missing: was a batch dim never added?"
    if len(got) != len(wanted):
        return f"expected {len(wanted)} dimensions, got {len(got)}."
    return "check which dimensions you reduce or rearrange."


PRECISION_HINT = "precision: the result is right to float32's rounding only; compute in the "
PRECISION_HINT += "input's dtype (float64 here: no .float(), no float32 constants) and return it."


def _gap(actual: Tensor, expected: Tensor) -> str:
    """How `actual` differs from `expected`: infinities where finite values belong (or the
    reverse) said as such, else the largest difference of the finite values."""
    both = actual.isfinite() & expected.isfinite()
    same = (actual == expected) | both
    if not same.all():
        where = int((~same).sum())
        ours, theirs = actual[~same][0].item(), expected[~same][0].item()
        return f"{where} entries are {ours} where the reference has {theirs}"
    return f"max abs diff {(actual.double() - expected.double())[both].abs().max():.3g}"


def _rounded(actual: Tensor, expected: Tensor) -> bool:
    """Whether `actual` is the float64 `expected` to float32's rounding: the formula right,
    the precision lost on the way."""
    if expected.dtype != torch.float64 or not expected.numel() or not expected.isfinite().all():
        return False
    tol, expected = 100 * torch.finfo(torch.float32).eps, expected.detach()
    scale = float(expected.abs().max())
    return torch.allclose(actual.detach().double(), expected, atol=tol * scale, rtol=tol)


def floats(values: Any) -> Tensor | str:
    """`values` as a float64 tensor, or what they are if they are not all numbers."""
    try:
        return torch.tensor([float(value) for value in values], dtype=torch.float64)
    except (TypeError, ValueError):
        return describe(values)


def expect_series(where: str, what: str, actual, expected, hint="", mistakes=None, *, tol=1e-9):
    """Numbers `what` against the expected ones within `tol` of the largest; a mistake named."""
    actual, expected = floats(actual), floats(expected)
    tol *= float(expected.abs().max()) if len(expected) else 1.0
    if matches(actual, expected, atol=tol):
        return
    problem = f"{what}: expected {expected.tolist()}, got {describe(actual)}."
    if isinstance(actual, Tensor) and actual.shape == expected.shape:
        i = int(((actual - expected).abs() > tol).nonzero()[0])
        problem = f"{what} {i}: expected {expected[i]:.6g}, got {actual[i]:.6g}."
    wrong = {h: floats(series) for h, series in (mistakes or {}).items()}
    expect_no_known_mistake(where, actual, wrong, atol=tol, problem=problem)
    expect(False, where, problem, hint)


def expect_schedule(name: str, fn: Callable, reference: Callable, cases, mistakes, hint: str):
    """A schedule `fn(step, **case)` at steps 0 to max_steps + 5 (or ten warmups), per case."""
    for case in cases:
        where = f"{name}(step, {', '.join(f'{k}={v}' for k, v in case.items())})"
        steps = range(case.get("max_steps", 10 * case["warmup_steps"]) + 6)
        rates = [call(where, fn, step, **case, hint=hint) for step in steps]
        other = next((r for r in rates if not isinstance(r, (int, float))), None)
        expect(other is None, where, f"returned {describe(other)}.", "return a float.")
        wrong = {h: [f(step, **case) for step in steps] for h, f in mistakes.items()}
        expected = [reference(step, **case) for step in steps]
        expect_series(where, "the rate at step", rates, expected, hint, wrong)


def expect_mask_not_inverted(name: str, pattern: Any, allowed: Tensor) -> None:
    """Fail if `pattern` weighs exactly the keys `allowed` forbids (NaN counting as 0)."""
    if not isinstance(pattern, Tensor) or not pattern.is_floating_point():
        return
    try:
        allowed = allowed.expand_as(pattern)
    except RuntimeError:
        return
    weights = pattern.detach().double().nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()
    inverted = weights[allowed].sum() < 1e-6 and weights[~allowed].sum() > 1e-3
    problem = "the mask is inverted: the forbidden keys get the weight and the allowed ones none."
    expect(not inverted, name, problem, CONVENTION_HINT)


def expect_hooks(name: str, module, reference, hints: dict[str, str], *args, atol=1e-8) -> None:
    """What each hook point in `hints` receives, against the reference's: named by its hint;
    then that what each hook returns is used (`expect_hooks_used`)."""
    seen, expected = {}, {}
    for where, found, model in ((name, seen, module), ("reference", expected, reference)):
        points = dict(model.named_modules())
        for hook in hints:
            problem = f"expected a hook point `{hook}` (a HookPoint made in __init__)."
            expect(isinstance(points.get(hook), HookPoint), where, problem, "keep the hooks.")
        record = {hook: lambda t, key=hook, found=found: found.update({key: t}) for hook in hints}
        _run_with_hooks(where, model, record, args)
    for hook, hint in hints.items():
        where = f"{name}.{hook}"
        expect(hook in seen, where, "this hook point never received a tensor.", hint)
        shape, got = tuple(expected[hook].shape), tuple(seen[hook].shape)
        expect(got == shape, where, f"expected shape {shape}, got {got}.", hint)
        same = matches(seen[hook], expected[hook], atol=atol)
        expect(same, where, "received a tensor that differs from the reference's.", hint)
    expect_hooks_used(name, module, reference, hints, *args)


def expect_hooks_used(name: str, module, reference, hooks, *args) -> None:
    """Each hook point in `hooks` replaces its tensor: where the reference's output changes,
    so must the learner's (a hook's return value is what flows on, as in TransformerLens)."""
    patch = lambda t: t * torch.linspace(0.5, 1.5, t.shape[-1], dtype=t.dtype)  # no norm undoes
    plain = [_run_with_hooks(name, m, {}, args) for m in (module, reference)]
    for hook in hooks:
        moved = [
            not matches(_run_with_hooks(name, m, {hook: patch}, args), out, atol=1e-9)
            for m, out in zip((module, reference), plain)
        ]
        where, problem = f"{name}, a hook on {hook} that replaces its tensor", "no effect."
        hint = f"use what self.{hook}(...) returns: a hook may replace the tensor it is given."
        expect(moved[0] or not moved[1], where, problem, hint)


def _run_with_hooks(name: str, model, hooks: dict[str, Callable], args: tuple):
    """`model(*args)` without gradients, each hook point `hooks` names running its function."""
    points = dict(model.named_modules())
    for hook, fn in hooks.items():
        points[hook].add_hook(lambda t, hook, fn=fn: fn(t))
    try:
        with torch.no_grad():
            return call(f"{name}.forward", model, *args)
    finally:
        for hook in hooks:
            points[hook].remove_hooks()


def seeded(seed: int) -> torch.Generator:
    """A random generator that always gives the same numbers."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    """Standard-normal values that the same seed always gives."""
    return torch.randn(shape, generator=seeded(seed), dtype=dtype)


def perturb(module: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """`module` with random offsets on every parameter, so a skipped one shows."""
    generator = seeded(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return module


def expect_same_in_train_mode(name: str, module, reference, *args: Any, hint: str, atol=1e-8):
    """With the reference's weights: dropout off in eval mode, and where the reference's falls
    in train mode."""
    call(f"{name}.load_state_dict", module.load_state_dict, reference.state_dict())
    module.eval(), reference.eval()
    where = f"{name} (eval mode)"
    off = "in eval mode dropout does nothing: nn.Dropout, or F.dropout(x, training=self.training)."
    with torch.no_grad():
        first, second = (call(f"{name}.forward", module, *args) for _ in range(2))
        expect_close(first, reference(*args), where, off, atol=atol)
    expect(torch.equal(first, second), where, "two calls give different outputs.", off)
    outputs = []
    for seeded_module in (reference.train(), module.train()):
        torch.manual_seed(1234)
        outputs.append(call(f"{name}.forward", seeded_module, *args))
    module.eval(), reference.eval()
    where = f"{name} (train mode, dropout on)"
    expect_close(outputs[1], outputs[0].detach(), where, hint, atol=atol)


def expect_cached(name: str, module, reference, x: Tensor, cuts: list[int], hint: str, **kwargs):
    """`module` fed `x` in pieces (cut at the positions `cuts`) through one `LayerCache` gives
    the output of `reference` on the whole of `x` (keywords `kwargs` to both)."""
    cache, pieces = LayerCache(), x.tensor_split(cuts, dim=1)
    with torch.no_grad():
        outputs = [call(name, module, piece, cache=cache, **kwargs) for piece in pieces]
        expect_close(torch.cat(outputs, dim=1), reference(x, **kwargs), name, hint, atol=1e-8)


def expect_evaluating(name: str, fn: Callable, model: torch.nn.Module, *args, **kwargs) -> Any:
    """`fn(model, ...)` runs `model` in eval mode without gradients, its mode restored."""
    runs: list[tuple[bool, bool]] = []
    record = lambda module, inputs: runs.append((module.training, torch.is_grad_enabled()))
    handles = [module.register_forward_pre_hook(record) for module in model.modules()]
    try:
        out = call(name, fn, model.train(), *args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    where = f"{name} (a model with dropout, in train mode)"
    problem = "the model ran in train mode, so dropout changed its outputs."
    expect(not any(train for train, _ in runs), where, problem, f"use eval mode: {EVAL_HINT}")
    problem = "gradients were tracked: every step built an autograd graph."
    expect(not any(grad for _, grad in runs), where, problem, f"use torch.no_grad(): {EVAL_HINT}")
    problem = "the model came in train mode and was left in eval mode."
    expect(model.training, where, problem, f"restore the model's mode: {EVAL_HINT}")
    return out


def load_reference_weights(name: str, module, reference, parts: str) -> None:
    """Give the learner's module the reference's weights, or say which attribute names it needs."""
    try:
        module.load_state_dict(reference.state_dict())
    except Exception as exc:
        problem = f"the reference weights do not load ({exc})."
        raise CheckFailure(f"`{name}`: {problem}\nHint: keep __init__'s names: {parts}.") from None


def passed(name: str) -> None:
    """Report a passed exercise."""
    print(f"✓ {name} passes every check")


def build_module(name: str, cls: type, *args, params: dict[str, tuple], **kwargs):
    """The learner's module, once its parameters' names and shapes are TransformerLens's."""
    module = call(f"{name}.__init__", cls, *args, **kwargs)
    found = dict(module.named_parameters()) if isinstance(module, torch.nn.Module) else {}
    shapes = {key: tuple(param.shape) for key, param in found.items()}
    hint = "keep the TransformerLens names and shapes, made in __init__: matrices (d_in, d_out), "
    hint += "embeddings (rows, d_model), a norm's w and b (d_model,)."
    for param, shape in params.items():
        problem = f"expected a parameter `{param}` of shape {shape}; found {shapes}."
        expect(shapes.get(param) == shape, name, problem, hint)
    return module
