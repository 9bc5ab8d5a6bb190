"""Run-time checks of the package's jaxtyping annotations while the tests run.

Every function and method of `transformer_course` whose annotations name a jaxtyping array type
(`Float[Tensor, "batch pos d_model"]`, ...) is wrapped: after each call that returns, its
arguments and its result are checked against those annotations, with the dimension names shared
across them (`batch` must be the same size everywhere), so a wrong shape, or a wrong shape
annotation, fails the test that made the call.

The check comes after the call, not before it: a call that raises (bad input meeting the
function's own validation) is left alone, so the tests of those clear errors still see them.
Only annotations that contain an array type are checked; the validators judge the rest (an int
annotation accepts a NumPy integer there, for instance). Compiled code is not checked.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import typing
from inspect import Parameter
from types import FunctionType, ModuleType
from typing import Any

import torch
from beartype.door import is_bearable
from jaxtyping import AbstractArray, TypeCheckError, jaxtyped

VAR_POSITIONAL = Parameter.VAR_POSITIONAL


def _has_array(hint: Any) -> bool:
    """Whether `hint` is, or contains (in a union, tuple, ...), a jaxtyping array type."""
    if isinstance(hint, type) and issubclass(hint, AbstractArray):
        return True
    return any(_has_array(arg) for arg in typing.get_args(hint))


def _array_hints(fn: FunctionType) -> dict[str, Any]:
    """The annotations of `fn` that contain an array type, by parameter name (and "return")."""
    found = {}
    for name, text in getattr(fn, "__annotations__", {}).items():
        try:
            hint = eval(text, fn.__globals__) if isinstance(text, str) else text  # noqa: S307
        except Exception:  # a name only imported for type checkers: not an array type here
            continue
        if _has_array(hint):
            found[name] = hint
    return found


def _wrap(fn: FunctionType, hints: dict[str, Any]) -> FunctionType:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        bound = signature.bind(*args, **kwargs)
        values = [(name, value) for name, value in bound.arguments.items() if name in hints]
        values = [  # each of *args on its own
            (name, item)
            for name, value in values
            for item in (value if signature.parameters[name].kind == VAR_POSITIONAL else [value])
        ]
        with jaxtyped("context"):
            for name, value in [*values, ("return", out)]:
                if name in hints and not is_bearable(value, hints[name]):
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                    where = "returned" if name == "return" else f"parameter {name!r} got"
                    raise TypeCheckError(
                        f"{fn.__module__}.{fn.__qualname__}: {where} {type(value).__name__} "
                        f"{shape}, annotated {hints[name]} (dimensions named alike must agree)"
                    )
        return out

    checked.__shape_checked__ = True
    return checked


def install(package_name: str = "transformer_course") -> int:
    """Import every module of the package and wrap each annotated function and method in
    place, in every module that holds it. Returns how many were wrapped."""
    package = importlib.import_module(package_name)
    modules: list[ModuleType] = [package] + [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages(package.__path__, f"{package_name}.")
    ]
    wrapped: dict[int, FunctionType] = {}
    for module in modules:
        for value in list(vars(module).values()):
            owner = getattr(value, "__module__", "") or ""
            if not owner.startswith(package_name):
                continue
            if isinstance(value, type):
                for attr, member in list(vars(value).items()):
                    if isinstance(member, FunctionType) and (hints := _array_hints(member)):
                        setattr(value, attr, wrapped.setdefault(id(member), _wrap(member, hints)))
            elif isinstance(value, FunctionType) and (hints := _array_hints(value)):
                wrapped.setdefault(id(value), _wrap(value, hints))
    for module in modules:  # every module's name for a wrapped function points at the wrapper
        for name, value in list(vars(module).items()):
            if isinstance(value, FunctionType) and id(value) in wrapped:
                setattr(module, name, wrapped[id(value)])
    return len(wrapped)
