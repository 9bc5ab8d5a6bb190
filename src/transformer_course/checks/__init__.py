"""Exercise checkers: compare a learner's function or class with the course's reference.

Each chapter's checkers live in `checks/<chapter>.py` and are built from the helpers here.
A checker either prints one line saying the exercise passes, or raises `CheckFailure`
with a targeted hint ("is eps inside the square root?"). In a notebook a failed check shows
its message alone, never the checker's code: the message is about the learner's code.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformer_lens.hook_points import HookPoint

__all__ = [
    "CheckFailure",
    "call",
    "construct",
    "expect",
    "expect_close",
    "expect_hooks",
    "expect_parameter",
    "expect_same_in_train_mode",
    "fill_random",
    "load_reference_weights",
    "passed",
]


CHECKERS = Path(__file__).resolve().parent


class CheckFailure(AssertionError):
    """An exercise check failed; the message says what went wrong and hints at why."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the message and, if the learner's code crashed, the frames of
        the learner's code that led there (never the checker's own frames)."""
        lines = f"CheckFailure: {self}".splitlines()
        cause = self.__cause__
        if cause is not None:
            frames = [
                frame
                for frame in traceback.extract_tb(cause.__traceback__)
                if not Path(frame.filename).resolve().is_relative_to(CHECKERS)
            ]
            lines += ["", "Where your code raised it:"]
            lines += "".join(traceback.format_list(frames)).rstrip("\n").splitlines()
            lines += traceback.format_exception_only(type(cause), cause)[-1:]
        return [line.rstrip("\n") for line in lines]


def call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the learner's `fn`, turning an unfinished blank or a crash into a `CheckFailure`."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        which = f" ({exc})" if str(exc) else ""
        raise CheckFailure(f"`{name}` is not implemented yet{which}.") from None
    except CheckFailure:
        raise
    except Exception as exc:  # the learner's code crashed: say where, keep the cause
        raise CheckFailure(f"`{name}` raised {type(exc).__name__}: {exc}") from exc


def construct(name: str, cls: type, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """Build the learner's module `cls(*args, **kwargs)`; a blank or a crash is a `CheckFailure`
    naming `name.__init__`."""
    return call(f"{name}.__init__", cls, *args, **kwargs)


def expect(condition: bool, name: str, problem: str, hint: str = "") -> None:
    """Fail with `problem` (and `hint`) unless `condition` holds."""
    if not condition:
        message = f"`{name}`: {problem}"
        if hint:
            message += f"\nHint: {hint}"
        raise CheckFailure(message)


def expect_close(
    actual: Any,
    expected: torch.Tensor,
    name: str,
    hint: str = "",
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """Check a tensor result: type, shape, no NaN, then values within `atol` + `rtol`."""
    expect(
        isinstance(actual, torch.Tensor),
        name,
        f"expected a torch.Tensor, got {type(actual).__name__}.",
    )
    expect(
        tuple(actual.shape) == tuple(expected.shape),
        name,
        f"expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}.",
        "check which dimensions you reduce or rearrange.",
    )
    expect(not torch.isnan(actual).any().item(), name, "the result contains NaN.", hint)
    actual = actual.detach().to(expected.dtype)
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
        worst = (actual - expected).abs().max().item()
        used = f"{expected.dtype} output of shape {tuple(expected.shape)}".replace("torch.", "")
        expect(
            False,
            name,
            f"values differ from the reference (max abs diff {worst:.3g}; {used}).",
            hint,
        )


def _hook_point(module: torch.nn.Module, hook: str, name: str) -> HookPoint:
    try:
        point = module.get_submodule(hook)
    except AttributeError:
        point = None
    expect(
        isinstance(point, HookPoint),
        name,
        f"expected a hook point `{hook}` (a transformer_lens HookPoint made in __init__).",
        "keep the hook points of the exercise's __init__; forward passes tensors through them.",
    )
    return point


def _record_hooks(module: torch.nn.Module, hooks: list[str], name: str, run: Callable[[], Any]):
    """Run `run()` recording the tensor each named hook point of `module` receives."""
    seen: dict[str, torch.Tensor] = {}
    points = {hook: _hook_point(module, hook, name) for hook in hooks}

    def recorder(key: str) -> Callable[..., None]:
        def save(tensor: torch.Tensor, hook: HookPoint) -> None:
            seen[key] = tensor.detach()

        return save

    for key, point in points.items():
        point.add_hook(recorder(key))
    try:
        out = run()
    finally:
        for point in points.values():
            point.remove_hooks()
    return out, seen


def expect_hooks(
    name: str,
    module: torch.nn.Module,
    reference: torch.nn.Module,
    hints: dict[str, str],
    *args: Any,
    atol: float = 1e-8,
) -> Any:
    """Run the learner's `module` and the `reference` on `args` and compare what each hook point
    in `hints` receives; the first that differs fails with its hint. Returns the module's output."""
    hooks = list(hints)
    out, seen = _record_hooks(module, hooks, name, lambda: call(f"{name}.forward", module, *args))
    with torch.no_grad():
        _, expected = _record_hooks(reference, hooks, "reference", lambda: reference(*args))
    for hook, hint in hints.items():
        where = f"{name}.{hook}"
        expect(hook in seen, where, "this hook point never received a tensor.", hint)
        actual, wanted = seen[hook], expected[hook]
        expect(
            tuple(actual.shape) == tuple(wanted.shape),
            where,
            f"expected shape {tuple(wanted.shape)}, got {tuple(actual.shape)}.",
            hint,
        )
        expect(
            torch.allclose(actual.to(wanted.dtype), wanted, atol=atol, rtol=1e-6),
            where,
            "received a tensor that differs from the reference's.",
            hint,
        )
    return out


def expect_parameter(
    module: torch.nn.Module, name: str, owner: str, shape: tuple[int, ...]
) -> torch.nn.Parameter:
    """The learner's parameter `module.<name>`, after checking that it is an `nn.Parameter` of
    `shape` (TransformerLens's layout)."""
    param = getattr(module, name, None)
    expect(
        isinstance(param, torch.nn.Parameter),
        owner,
        f"expected a parameter named `{name}` (an nn.Parameter), got {type(param).__name__}.",
        f"create it in __init__: self.{name} = nn.Parameter(torch.empty{shape}).",
    )
    expect(
        tuple(param.shape) == shape,
        owner,
        f"`{name}` should have shape {shape}, got {tuple(param.shape)}.",
        "TransformerLens layout: matrices are (d_in, d_out), embeddings are (rows, d_model).",
    )
    return param


def fill_random(*params: torch.nn.Parameter, seed: int = 1) -> None:
    """Give `params` standard-normal values, so a forward pass that ignores one shows up."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in params:
            param.copy_(torch.randn(param.shape, generator=generator))


def expect_same_in_train_mode(
    name: str,
    module: torch.nn.Module,
    reference: torch.nn.Module,
    *args: Any,
    hint: str,
    atol: float = 1e-8,
) -> None:
    """Dropout: in eval mode two calls agree with the reference (no dropout at all); in train
    mode, under the same seed, the learner's dropout falls where the reference's does."""
    module.eval(), reference.eval()
    with torch.no_grad():
        expected = reference(*args)
        first, second = (
            call(f"{name}.forward", module, *args),
            call(f"{name}.forward", module, *args),
        )
    expect_close(
        first,
        expected,
        f"{name} (eval mode)",
        "in eval mode dropout must do nothing: use "
        "nn.Dropout modules or F.dropout(..., training=self.training).",
        atol=atol,
    )
    expect(
        torch.equal(first, second),
        f"{name} (eval mode)",
        "two calls give different outputs.",
        "dropout is still active in eval mode: use F.dropout(..., training=self.training).",
    )
    module.train(), reference.train()
    try:
        torch.manual_seed(1234)
        expected = reference(*args)
        torch.manual_seed(1234)
        actual = call(f"{name}.forward", module, *args)
    finally:
        module.eval(), reference.eval()
    expect_close(actual, expected.detach(), f"{name} (train mode, dropout on)", hint, atol=atol)


def load_reference_weights(
    name: str, module: torch.nn.Module, reference: torch.nn.Module, parts: str
) -> None:
    """Give the learner's module the reference's weights, or say which attribute names it needs."""
    try:
        module.load_state_dict(reference.state_dict())
    except Exception as exc:
        raise CheckFailure(
            f"`{name}`: the reference weights do not load ({exc}).\n"
            f"Hint: keep the attribute names of __init__: {parts}."
        ) from None


def passed(name: str) -> None:
    """Report a passed exercise."""
    print(f"✓ {name} passes every check")
