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

__all__ = ["CheckFailure", "call", "expect", "expect_close", "passed"]


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
    expect(isinstance(actual, torch.Tensor), name, f"expected a torch.Tensor, got {type(actual).__name__}.")
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
        expect(False, name, f"values differ from the reference (max abs diff {worst:.3g}).", hint)


def passed(name: str) -> None:
    """Report a passed exercise."""
    print(f"✓ {name} passes every check")
