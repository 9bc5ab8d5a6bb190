"""Reading and editing a model's activations by name, as TransformerLens names them.

The course's models (chapter 6's `GPT2`, chapter 7's `Llama`, chapter 10's attention-only
transformer) are TransformerLens `HookedRootModule`s: every intermediate tensor passes a
`HookPoint` named like TransformerLens's (`blocks.0.attn.hook_pattern`,
`blocks.1.hook_resid_pre`, ...). `run_with_cache` keeps the ones asked for; `run_with_hooks`
runs the model with functions that replace them (what ablation and patching are built on).
Both check the names first, and a misspelt one is an error that lists the nearest real names,
not a silent run that caches or edits nothing.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping

from jaxtyping import Int
from torch import Tensor
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course.runtime import evaluating

__all__ = [
    "Hook",
    "hook_names",
    "check_hook_names",
    "activation",
    "run_with_cache",
    "run_with_hooks",
]

Hook = Callable[..., Tensor]  # (activation, hook) -> the activation to use instead


def hook_names(model: HookedRootModule) -> list[str]:
    """Every hook point of `model`, in the order the forward pass reaches them."""
    if not isinstance(model, HookedRootModule):
        raise TypeError(f"model: expected a HookedRootModule, got {type(model).__name__}")
    return list(model.hook_dict)


def _unknown(name: str, known: Iterable[str], where: str) -> KeyError:
    """The error for a name that is not among `known`, with the nearest ones listed."""
    near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5)
    maybe = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
    return KeyError(f"{where}: no activation named {name!r}{maybe}")


def check_hook_names(model: HookedRootModule, names: Iterable[str]) -> list[str]:
    """`names` as a list, once each is a hook point of `model` (else a KeyError naming it)."""
    known = set(hook_names(model))
    names = [names] if isinstance(names, str) else list(names)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"hook name: expected a string, got {type(name).__name__}")
        if name not in known:
            raise _unknown(name, known, "model")
    return names


def activation(cache: Mapping[str, Tensor], name: str) -> Tensor:
    """The activation `name` from a cache, or a KeyError that says what the cache holds."""
    if name not in cache:
        near = difflib.get_close_matches(name, list(cache), n=3, cutoff=0.5)
        kept = near or list(cache)[:4]
        which = "the nearest it holds" if near else f"it holds {len(cache)}, among them"
        raise KeyError(
            f"cache: no activation named {name!r} ({which}: {', '.join(map(repr, kept))}); "
            "cache it by running with it among the names"
        )
    return cache[name]


def run_with_cache(
    model: HookedRootModule, tokens: Int[Tensor, "batch pos"], names: Iterable[str] | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """The logits of `tokens` and the activations `names` (every hook point if None), in eval
    mode without gradients: `{name: tensor}` with each tensor as its hook point saw it."""
    names = hook_names(model) if names is None else check_hook_names(model, names)
    with evaluating(model):
        logits, cache = model.run_with_cache(tokens, names_filter=names)
    return logits, dict(cache)


def run_with_hooks(
    model: HookedRootModule, tokens: Int[Tensor, "batch pos"], hooks: Mapping[str, Hook]
) -> Tensor:
    """The logits of `tokens` when each hook point named in `hooks` hands its activation to the
    function there and the model goes on with what that returns (eval mode, no gradients).

    A hook must return the tensor to use, of the activation's shape: one that returns None
    (edits a copy and forgets to return it) is an error, not an edit that silently vanishes.

    Course: chapter 10, exercise 10.1, checked by checks.interpretability.check_run_with_hooks.
    """
    check_hook_names(model, hooks)

    def returning(name: str, fn: Hook) -> Hook:
        def hook(act: Tensor, hook) -> Tensor:
            out = fn(act, hook)
            if not isinstance(out, Tensor) or out.shape != act.shape:
                got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                raise ValueError(
                    f"hook on {name!r}: expected it to return the edited activation of shape "
                    f"{tuple(act.shape)}, got {got}"
                )
            return out

        return hook

    fwd_hooks = [(name, returning(name, fn)) for name, fn in hooks.items()]
    with evaluating(model):
        return model.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
