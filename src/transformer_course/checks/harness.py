"""What every checker is built from: run the learner's code, compare it with the course's
reference, and when they differ name the likely mistake.

A checker prints one line saying the exercise passes, or raises `CheckFailure` with a targeted
hint ("is eps inside the square root?"). A known mistake is named one way everywhere: the
learner's output is compared with a table {hint naming the mistake: the output that mistake
gives} (`known_mistake`, `expect_no_known_mistake`, `expect_close(..., mistakes=)`).
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from transformer_course.blocks import TransformerBlock

CHECKERS = Path(__file__).resolve().parent
DIFFERS = "values differ from the reference."
CONVENTION_HINT = (
    "True means *may attend* (PyTorch's convention): keep the scores where the mask is True and "
    "fill the ones where it is False (`~mask`)."
)
OVERFLOW_HINT = (
    "exp overflows for large scores (above about 88 in float32, 709 in float64): subtract each "
    "row's maximum before exp, as `torch.softmax` does (a constant shift changes nothing)."
)
EVAL_HINT = "`with evaluating(model):` sets eval mode and no_grad, and restores the mode after."


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


def call(name: str, fn: Callable[..., Any], *args: Any, hint: str = "", **kwargs: Any) -> Any:
    """Call the learner's `fn`: an unfinished blank or a crash becomes a `CheckFailure`, a crash
    with `hint` when one is given."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        which = f" ({exc})" if str(exc) else ""
        raise CheckFailure(f"`{name}` is not implemented yet{which}.") from None
    except CheckFailure:
        raise
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


def describe(value: Any) -> str:
    """A short description of a value, for a message."""
    if isinstance(value, Tensor):
        return f"a {str(value.dtype)[6:]} tensor of shape {tuple(value.shape)}"
    return f"{value!r:.200}"


def shape_of(value: Any) -> tuple | str:
    """The shape of a tensor, or what else `value` is."""
    return tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__


def matches(actual: Any, wanted: Any, atol: float = 1e-6) -> bool:
    """Whether `actual` is `wanted`: float tensors of one shape within `atol`, other tensors
    exactly, floats within a millionth of each other, anything else equal."""
    if isinstance(wanted, Tensor):
        if shape_of(actual) != tuple(wanted.shape):
            return False
        if not wanted.is_floating_point():
            return torch.equal(actual.detach().to(wanted.dtype), wanted)
        return torch.allclose(actual.detach().double(), wanted.detach().double(), atol=atol)
    if isinstance(wanted, float) and isinstance(actual, (int, float)):
        return math.isclose(actual, wanted, rel_tol=1e-6)
    return isinstance(actual, type(wanted)) and actual == wanted


def known_mistake(actual: Any, mistakes: Mapping[str, Any], *, atol: float = 1e-6) -> str | None:
    """The hint of the first mistake in `mistakes` ({hint: the output that mistake gives})
    whose output `actual` is, or None."""
    return next((hint for hint, wrong in mistakes.items() if matches(actual, wrong, atol)), None)


def expect_no_known_mistake(name: str, actual, mistakes: Mapping, *, atol=1e-6, problem=DIFFERS):
    """Fail with the hint of the mistake in `mistakes` whose output `actual` is, if any."""
    hint = known_mistake(actual, mistakes, atol=atol)
    expect(hint is None, name, problem, hint or "")


def expect_close(actual, expected, name: str, hint="", *, atol=1e-5, rtol=1e-4, mistakes=None):
    """A tensor result's type, shape, no NaN, then values within `atol` + `rtol`; any other
    result must equal `expected`. A result that a known mistake gives fails with its hint."""
    if not isinstance(expected, Tensor):
        if not matches(actual, expected):
            problem = f"expected {describe(expected)}, got {describe(actual)}."
            expect_no_known_mistake(name, actual, mistakes or {}, problem=problem)
            expect(False, name, problem, hint)
        return
    expect(isinstance(actual, Tensor), name, f"expected a torch.Tensor, got {describe(actual)}.")
    shape, got = tuple(expected.shape), tuple(actual.shape)
    sizes = "check which dimensions you reduce or rearrange."
    expect(got == shape, name, f"expected shape {shape}, got {got}.", sizes)
    expect(not torch.isnan(actual).any(), name, "the result contains NaN.", hint)
    actual = actual.detach().to(expected.dtype)
    if not torch.allclose(actual, expected, atol=atol, rtol=rtol):
        expect_no_known_mistake(name, actual, mistakes or {}, atol=atol)
        worst = (actual - expected).abs().max().item()
        used = f"{str(expected.dtype)[6:]} output of shape {shape}"
        problem = f"values differ from the reference (max abs diff {worst:.3g}; {used})."
        expect(False, name, problem, hint)


def expect_mask_not_inverted(name: str, pattern: Any, allowed: Tensor) -> None:
    """Fail with the mask convention's hint if `pattern` gives its weight to the keys `allowed`
    forbids and none to those it allows, NaN rows counting as zero."""
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


def run_hooked(name: str, module: torch.nn.Module, hooks: list[str], *args: Any):
    """`module(*args)` and what each named hook point of it received."""
    points, seen = dict(module.named_modules()), {}
    for hook in hooks:
        problem = f"expected a hook point `{hook}` (a transformer_lens HookPoint made in __init__)."
        expect(isinstance(points.get(hook), HookPoint), name, problem, "keep __init__'s hooks.")
        points[hook].add_hook(lambda tensor, hook, key=hook: seen.update({key: tensor.detach()}))
    try:
        return call(f"{name}.forward", module, *args), seen
    finally:
        for hook in hooks:
            points[hook].remove_hooks()


def expect_hooks(name: str, module, reference, hints: dict[str, str], *args, atol=1e-8) -> Any:
    """Compare what each hook point in `hints` receives in the learner's `module` and in the
    `reference` on `args`; the first that differs fails with its hint."""
    out, seen = run_hooked(name, module, list(hints), *args)
    with torch.no_grad():
        _, expected = run_hooked("reference", reference, list(hints), *args)
    for hook, hint in hints.items():
        where = f"{name}.{hook}"
        expect(hook in seen, where, "this hook point never received a tensor.", hint)
        shape, got = tuple(expected[hook].shape), tuple(seen[hook].shape)
        expect(got == shape, where, f"expected shape {shape}, got {got}.", hint)
        same = matches(seen[hook], expected[hook], atol=atol)
        expect(same, where, "received a tensor that differs from the reference's.", hint)
    return out


def seeded(seed: int) -> torch.Generator:
    """A random generator that always gives the same numbers."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> Tensor:
    """Standard-normal values that the same seed always gives."""
    return torch.randn(shape, generator=seeded(seed), dtype=dtype)


def perturb(module: torch.nn.Module, seed: int, scale: float = 0.3) -> torch.nn.Module:
    """`module` with random offsets on every parameter (layer-norm gains and biases included),
    so a forward pass that skips one, or uses it in the wrong place, shows up."""
    generator = seeded(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return module


def expect_same_in_train_mode(name: str, module, reference, *args: Any, hint: str, atol=1e-8):
    """Dropout: in eval mode two calls agree with the reference (no dropout at all); in train
    mode, under the same seed, the learner's dropout falls where the reference's does."""
    module.eval(), reference.eval()
    where, off = f"{name} (eval mode)", "in eval mode dropout does nothing: use nn.Dropout or "
    off += "F.dropout(..., training=self.training)."
    with torch.no_grad():
        first, second = (call(f"{name}.forward", module, *args) for _ in range(2))
        expect_close(first, reference(*args), where, off, atol=atol)
    expect(torch.equal(first, second), where, "two calls give different outputs.", off)
    module.train(), reference.train()
    try:
        torch.manual_seed(1234)
        expected = reference(*args)
        torch.manual_seed(1234)
        actual = call(f"{name}.forward", module, *args)
    finally:
        module.eval(), reference.eval()
    expect_close(actual, expected.detach(), f"{name} (train mode, dropout on)", hint, atol=atol)


def expect_evaluating(name: str, fn: Callable, model: torch.nn.Module, *args, **kwargs) -> Any:
    """The learner's `fn(model, ...)` with `model` in train mode, which every module must run in
    eval mode (no dropout) without gradients, the model coming back in train mode."""
    runs: list[tuple[bool, bool]] = []

    def record(module: torch.nn.Module, inputs: Any) -> None:
        runs.append((module.training, torch.is_grad_enabled()))

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


# The transformer block: one class serves chapter 5's encoder and decoder and chapter 6's GPT-2.

BLOCK_HOOKS = {
    "hook_resid_pre": "pass the incoming residual stream through self.hook_resid_pre first.",
    "hook_attn_out": "hook_attn_out gets what self-attention adds to the stream, after dropout.",
    "hook_resid_mid": "hook_resid_mid gets the stream after the self-attention sublayer.",
    "hook_mlp_out": "hook_mlp_out gets what the MLP adds to the stream, after dropout.",
    "hook_resid_post": "hook_resid_post gets the block's output.",
}
CROSS_HOOKS = {
    "hook_cross_attn_out": "hook_cross_attn_out gets what the cross-attention adds.",
    "hook_resid_mid_cross": "hook_resid_mid_cross gets the stream after the cross-attention.",
}
BLOCK_MISTAKES = [  # (what is wrong, as keywords of `block_output`; the hint naming it)
    ({"mask": None}, "the padding is visible: the mask is ignored; pass mask=mask to self.attn."),
    ({"no_cross": True}, "the cross-attention sublayer is missing: it follows self-attention."),
    ({"context_mask": None}, "the cross-attention ignores the source padding: pass context_mask."),
    ({"context": None, "context_mask": None}, "cross-attention's keys and values are context."),
    ({"ln_cross": "ln1"}, "each sublayer has its own layer norm: self.ln_cross for this one."),
    ({"ln_cross": "ln2"}, "the cross-attention's layer norm is self.ln_cross, not self.ln2."),
    ({"cross_first": True}, "the order is self-attention, then cross-attention, then the MLP."),
    ({"residual": False}, "a residual connection is missing: add each sublayer's output to x."),
]
NORMS = {"pre": "x = x + attn(ln1(x)), then x = x + mlp(ln2(x))", "post": "x = ln1(x + attn(x))"}
CAUSAL_HINTS = {  # by the block's `causal`
    True: "the self-attention must be causal: causal=self.causal (causal=True in GPT-2).",
    False: "this block's self-attention is not causal: pass causal=self.causal.",
}


def block_output(block: TransformerBlock, x, mask=None, context=None, context_mask=None, **wrong):
    """The reference `block`'s forward pass built from its own parts, with what is `wrong`: the
    other norm or causality, a layer norm swapped, the sublayers reordered, the stream
    normalised by the first sublayer, or no residual connections."""
    norm, causal = wrong.get("norm", block.norm), wrong.get("causal", block.causal)

    def sublayer(r: Tensor, f: Callable[[Tensor], Tensor], ln: Callable, first: bool) -> Tensor:
        stream = ln(r) if first and wrong.get("normed_stream") else r
        stream = stream if wrong.get("residual", True) else torch.zeros_like(r)
        return stream + f(ln(r)) if norm == "pre" else ln(stream + f(r))

    steps = [(lambda h: block.attn(h, mask=mask, causal=causal), block.ln1)]
    if block.cross_attention and not wrong.get("no_cross"):
        ln_cross = getattr(block, wrong.get("ln_cross", "ln_cross"))
        cross = (lambda h: block.cross_attn(h, context, mask=context_mask), ln_cross)
        steps.insert(0 if wrong.get("cross_first") else 1, cross)
    for index, (f, ln) in enumerate(steps):
        x = sublayer(x, f, ln, first=index == 0)
    return sublayer(x, block.mlp, block.ln2, first=False)


def expect_block(name: str, cls: type, settings: dict, cases: list, *, hint: str, crash=""):
    """The learner's `TransformerBlock` built with `settings` and the reference's perturbed
    weights: its output in each of `cases` (label, args, kwargs), a known wiring mistake named;
    its hook points; its dropout in train and eval mode."""
    torch.manual_seed(1)
    reference = perturb(TransformerBlock(16, 4, 4, 32, **settings).double(), seed=2).eval()
    block = call(f"{name}.__init__", cls, 16, 4, 4, 32, **settings).double()
    load_reference_weights(name, block, reference, "ln1, attn, ln_cross, cross_attn, ln2, mlp")
    other = "post" if block.norm == "pre" else "pre"
    norm = f"this is {other}-LN: with norm={block.norm!r}, {NORMS[block.norm]}."
    wrongs = [({"norm": other}, norm), ({"causal": not block.causal}, CAUSAL_HINTS[block.causal])]
    wrongs += BLOCK_MISTAKES
    if block.norm == "pre":
        stream = "only the sublayer's input is normalised; the residual stream itself stays as is."
        wrongs.append(({"normed_stream": True}, stream))
    for label, args, kwargs in cases:
        where = f"{name}, {label}"
        with torch.no_grad():
            actual = call(where, block.eval(), *args, hint=crash or hint, **kwargs)
            problem = f"expected the stream's shape {tuple(args[0].shape)}, got {shape_of(actual)}."
            expect(shape_of(actual) == args[0].shape, where, problem, crash or hint)
            inputs = dict(zip(("x", "mask", "context", "context_mask"), args), **kwargs)
            mistakes = {h: block_output(reference, **{**inputs, **w}) for w, h in wrongs}
            expected = reference(*args, **kwargs)
        expect_close(actual, expected, where, hint, atol=1e-6, mistakes=mistakes)
    hooks = {**BLOCK_HOOKS, **(CROSS_HOOKS if settings.get("cross_attention") else {})}
    expect_hooks(name, block, reference, hooks, *cases[0][1])
    torch.manual_seed(1)
    ours = TransformerBlock(16, 4, 4, 32, **settings, dropout=0.3).double()
    theirs = call(f"{name}.__init__", cls, 16, 4, 4, 32, **settings, dropout=0.3).double()
    theirs.load_state_dict(ours.state_dict())
    hint = "give every residual_sublayer dropout=self.dropout, and add no other dropout."
    expect_same_in_train_mode(f"{name}, dropout=0.3", theirs, ours, *cases[0][1], hint=hint)
