"""Checkers for the transformer block's parts (`transformer_course.blocks`): the MLP and the
block itself, pre-LN and post-LN (chapter 6's workbook; the block serves chapters 4-6).

Each checker builds the learner's class next to the course's reference with identical weights
and compares outputs, hook by hook; known mistakes get targeted hints.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from transformer_course.blocks import MLP as ReferenceMLP
from transformer_course.blocks import TransformerBlock
from transformer_course.checks import (
    call,
    construct,
    expect,
    expect_close,
    expect_hooks,
    expect_parameter,
    expect_same_in_train_mode,
    fill_random,
    load_reference_weights,
    passed,
)
from transformer_course.masking import causal_mask, combine_masks, padding_mask

__all__ = ["check_mlp", "check_transformer_block"]

MLP_HOOKS = {
    "hook_pre": "pass x @ W_in + b_in (before the activation) through self.hook_pre.",
    "hook_post": "pass the activation's output through self.hook_post, before W_out.",
}
BLOCK_HOOKS = {
    "hook_resid_pre": "pass the incoming residual stream through self.hook_resid_pre first.",
    "hook_attn_out": "hook_attn_out gets what attention adds to the stream (after dropout).",
    "hook_resid_mid": "hook_resid_mid gets the stream after the attention sublayer.",
    "hook_mlp_out": "hook_mlp_out gets what the MLP adds to the stream (after dropout).",
    "hook_resid_post": "hook_resid_post gets the block's output.",
}


def check_mlp(MLP: type) -> None:
    """`MLP(d_model, d_mlp, act_fn="gelu_new")`: `W_out(gelu_new(x @ W_in + b_in)) + b_out`."""
    name = "MLP"
    d_model, d_mlp = 16, 64
    mlp = construct(name, MLP, d_model, d_mlp)
    W_in = expect_parameter(mlp, "W_in", name, (d_model, d_mlp))
    b_in = expect_parameter(mlp, "b_in", name, (d_mlp,))
    W_out = expect_parameter(mlp, "W_out", name, (d_mlp, d_model))
    b_out = expect_parameter(mlp, "b_out", name, (d_model,))
    fill_random(W_in, b_in, W_out, b_out)
    x = torch.randn(2, 5, d_model, generator=torch.Generator().manual_seed(3))
    out = call(f"{name}.forward", mlp, x)

    def with_activation(act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return act(x @ W_in.detach() + b_in.detach()) @ W_out.detach() + b_out.detach()

    expected = with_activation(lambda h: F.gelu(h, approximate="tanh"))
    if _same_shape_but_different(out, expected, atol=1e-5):
        for wrong, hint in (
            (
                F.gelu,
                "GPT-2 uses gelu_new, the tanh approximation: F.gelu(x, approximate='tanh'), "
                "not the exact erf GELU.",
            ),
            (F.relu, "the activation is GELU (gelu_new), not ReLU."),
        ):
            expect(
                not _close(out, with_activation(wrong), atol=1e-5),
                name,
                "the activation function is not GPT-2's.",
                hint,
            )
    expect_close(out, expected, name, "x @ W_in + b_in, then gelu_new, then @ W_out + b_out.")

    for act_fn in ("relu", "gelu"):
        where = f"{name}(act_fn={act_fn!r})"
        theirs = call(where, MLP, d_model, d_mlp, act_fn=act_fn)
        reference = ReferenceMLP(d_model, d_mlp, act_fn=act_fn)
        reference.load_state_dict(mlp.state_dict())
        theirs.load_state_dict(mlp.state_dict())
        expect_close(
            call(where, theirs, x),
            reference(x).detach(),
            where,
            "use the activation the module was built with, ACTIVATIONS[self.act_fn].",
        )
    reference = ReferenceMLP(d_model, d_mlp)
    reference.load_state_dict(mlp.state_dict())
    expect_hooks(name, mlp, reference, MLP_HOOKS, x, atol=1e-6)
    passed(name)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-8) -> bool:
    """Same shape and the same values within `atol`, compared in float64."""
    return a.shape == b.shape and torch.allclose(
        a.detach().double(), b.detach().double(), atol=atol
    )


def _same_shape_but_different(out: object, expected: torch.Tensor, atol: float = 1e-8) -> bool:
    """True when `out` is a tensor of the expected shape whose values differ: the case where
    comparing with known mistakes can name the one made."""
    return (
        isinstance(out, torch.Tensor)
        and out.shape == expected.shape
        and not _close(out, expected, atol)
    )


def _block_mistakes(
    block: TransformerBlock, x: torch.Tensor, mask: torch.Tensor | None
) -> dict[str, torch.Tensor]:
    """The outputs of the classic block mistakes, built from the reference's own sublayers,
    keyed by the hint that names each."""
    pos = x.shape[1]
    causal = combine_masks(causal_mask(pos), mask)

    def attn(h: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        return block.attn(h, mask=m)

    def pre_ln(h: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        mid = h + attn(block.ln1(h), m)
        return mid + block.mlp(block.ln2(mid))

    def post_ln(h: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
        mid = block.ln1(h + attn(h, m))
        return block.ln2(mid + block.mlp(mid))

    right, wrong = (pre_ln, post_ln) if block.norm == "pre" else (post_ln, pre_ln)
    other = "post" if block.norm == "pre" else "pre"
    how = (
        "normalise each sublayer's input: x = x + attn(ln1(x)), then x = x + mlp(ln2(x))."
        if block.norm == "pre"
        else "normalise after each residual sum: x = ln1(x + attn(x))."
    )
    mistakes = {
        "attention must be causal: call self.attn(..., mask=mask, causal=True), so no position "
        "sees a later one.": right(x, mask),
        f"this is {other}-LN; with norm={block.norm!r} {how}": wrong(x, causal),
        "the mask you are given is ignored: pass it on to attention (mask=mask).": right(
            x, causal_mask(pos)
        ),
    }
    if block.norm == "pre":
        normed = block.ln1(x)
        mid = normed + attn(normed, causal)
        hint = (
            "only the sublayer's input is normalised; the residual stream itself stays as it "
            "is: x = x + attn(ln1(x)), not ln1(x) + attn(ln1(x))."
        )
        mistakes[hint] = mid + block.mlp(block.ln2(mid))
        mid = attn(block.ln1(x), causal)
        hint = (
            "a residual connection is missing: add each sublayer's output to the stream, "
            "x = x + ..."
        )
        mistakes[hint] = block.mlp(block.ln2(mid))
        mistakes[hint + " (the attention's)"] = mid + block.mlp(block.ln2(mid))
    return mistakes


def _noisy_block(norm: str) -> TransformerBlock:
    """The course's block in float64 with noise on every parameter (layer-norm gains and biases
    included), so a forward pass that skips one shows up."""
    torch.manual_seed(5)
    reference = TransformerBlock(16, 4, 4, 32, norm=norm).double().eval()
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for param in reference.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64))
    return reference


def check_transformer_block(cls: type) -> None:
    """`TransformerBlock(d_model, n_heads, d_head, d_mlp, *, norm, dropout, ...)`: causal
    self-attention and an MLP on the residual stream, pre-LN or post-LN."""
    name = "TransformerBlock"
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    padding = padding_mask(torch.tensor([[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]), 0)
    for norm in ("pre", "post"):
        reference = _noisy_block(norm)
        block = construct(f"{name}(norm={norm!r})", cls, 16, 4, 4, 32, norm=norm).double()
        load_reference_weights(name, block, reference, "ln1, attn, ln2, mlp")
        block.eval()
        for mask, label in ((None, "no mask"), (padding, "a padding mask")):
            where = f"{name}(norm={norm!r}), {label}"
            with torch.no_grad():
                out = call(where, block, x, mask)
                expected = reference(x, mask)
                if _same_shape_but_different(out, expected):
                    for hint, wrong in _block_mistakes(reference, x, mask).items():
                        expect(
                            not _close(out, wrong),
                            where,
                            "values differ from the reference.",
                            hint,
                        )
            expect_close(
                out,
                expected,
                where,
                "x = x + dropout(attn(ln1(x), causal mask)); x = x + dropout(mlp(ln2(x))) for "
                "pre-LN.",
                atol=1e-8,
            )
        expect_hooks(f"{name}(norm={norm!r})", block, reference, BLOCK_HOOKS, x, atol=1e-8)
        theirs = construct(name, cls, 16, 4, 4, 32, norm=norm, dropout=0.3).double()
        ours = TransformerBlock(16, 4, 4, 32, norm=norm, dropout=0.3).double()
        theirs.load_state_dict(ours.state_dict())
        expect_same_in_train_mode(
            f"{name}(norm={norm!r}, dropout=0.3)",
            theirs,
            ours,
            x,
            hint="apply self.dropout to each sublayer's output before adding it to the stream "
            "(twice: attention, MLP), and nowhere else.",
        )
    passed(name)
