"""The block checkers (`checks.blocks`): the references pass, a blank fails with its hint, and
classic bugs get targeted hints (each bug is written out here as a small variant of the
reference)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from transformer_course.blocks import ACTIVATIONS, MLP, TransformerBlock
from transformer_course.checks import CheckFailure
from transformer_course.checks.blocks import check_mlp, check_transformer_block
from transformer_course.masking import causal_mask, combine_masks


def fails(check, candidate, *words: str) -> None:
    with pytest.raises(CheckFailure) as info:
        check(candidate)
    message = str(info.value)
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in: {message}"


# The MLP.


def test_mlp_reference_passes(capsys):
    check_mlp(MLP)
    assert "passes every check" in capsys.readouterr().out


class BlankMLP(MLP):
    def forward(self, x):
        raise NotImplementedError("widen, gelu_new, project back")


def test_mlp_blank_fails_with_its_hint():
    fails(check_mlp, BlankMLP, "not implemented", "widen")


class ExactGeluMLP(MLP):
    def forward(self, x):
        return F.gelu(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


class ReluMLP(MLP):
    def forward(self, x):
        return F.relu(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


def test_mlp_rejects_wrong_activation():
    fails(check_mlp, ExactGeluMLP, "tanh")
    fails(check_mlp, ReluMLP, "relu")


class FixedGeluMLP(MLP):
    """Ignores `act_fn`: always gelu_new."""

    def forward(self, x):
        pre = self.hook_pre(x @ self.W_in + self.b_in)
        return self.hook_post(F.gelu(pre, approximate="tanh")) @ self.W_out + self.b_out


class UnhookedMLP(MLP):
    def forward(self, x):
        pre = self.hook_pre(x @ self.W_in + self.b_in)
        return ACTIVATIONS[self.act_fn](pre) @ self.W_out + self.b_out


def test_mlp_rejects_an_ignored_act_fn_and_a_missing_hook():
    fails(check_mlp, FixedGeluMLP, "act_fn='relu'", "ACTIVATIONS[self.act_fn]")
    fails(check_mlp, UnhookedMLP, "hook_post", "never received")


class EinsumMLP(MLP):
    """A valid alternative: torch.einsum instead of einops, F.gelu written out."""

    def forward(self, x):
        pre = self.hook_pre(torch.einsum("bpd,dm->bpm", x, self.W_in) + self.b_in)
        post = self.hook_post(ACTIVATIONS[self.act_fn](pre))
        return torch.einsum("bpm,md->bpd", post, self.W_out) + self.b_out


def test_mlp_alternative_passes():
    check_mlp(EinsumMLP)


# The transformer block.


def block_with(forward):
    return type("LearnerBlock", (TransformerBlock,), {"forward": forward})


def _sublayers(
    self, resid, mask, *, causal=True, pre_ln=True, keep_stream=True, residual=True, drop=True
):
    """A block forward pass with one knob turned wrong at a time."""
    if causal:
        mask = combine_masks(causal_mask(resid.shape[1]), mask)
    dropout = self.dropout if drop else (lambda t: t)
    resid = self.hook_resid_pre(resid)
    if pre_ln if self.norm == "pre" else not pre_ln:
        stream = resid if keep_stream else self.ln1(resid)
        attn_out = self.hook_attn_out(dropout(self.attn(self.ln1(resid), mask=mask)))
        resid = self.hook_resid_mid((stream if residual else 0) + attn_out)
        mlp_out = self.hook_mlp_out(dropout(self.mlp(self.ln2(resid))))
        return self.hook_resid_post((resid if residual else 0) + mlp_out)
    attn_out = self.hook_attn_out(dropout(self.attn(resid, mask=mask)))
    resid = self.hook_resid_mid(self.ln1(resid + attn_out))
    mlp_out = self.hook_mlp_out(dropout(self.mlp(resid)))
    return self.hook_resid_post(self.ln2(resid + mlp_out))


@pytest.mark.parametrize(
    ("knob", "words"),
    [
        ({"causal": False}, ["causal=True"]),
        ({"pre_ln": False}, ["this is post-LN"]),
        ({"keep_stream": False}, ["residual stream itself"]),
        ({"residual": False}, ["a residual connection is missing"]),
        ({"drop": False}, ["dropout=0.3", "train mode"]),
    ],
)
def test_transformer_block_bugs_are_named(knob, words):
    forward = block_with(lambda self, resid, mask=None: _sublayers(self, resid, mask, **knob))
    fails(check_transformer_block, forward, *words)


def test_transformer_block_that_ignores_its_mask_or_hooks_is_caught():
    forward = block_with(lambda self, resid, mask=None: _sublayers(self, resid, None))
    fails(check_transformer_block, forward, "a padding mask", "ignored")

    def unhooked(self, resid, mask=None):
        mask = combine_masks(causal_mask(resid.shape[1]), mask)
        resid = resid + self.dropout(self.attn(self.ln1(resid), mask=mask))
        return resid + self.dropout(self.mlp(self.ln2(resid)))

    fails(check_transformer_block, block_with(unhooked), "hook_resid_pre", "never received")


def test_transformer_block_reference_explicit_mask_alternative_and_blank():
    check_transformer_block(TransformerBlock)
    check_transformer_block(
        block_with(lambda self, resid, mask=None: _sublayers(self, resid, mask))
    )

    def blank(self, resid, mask=None):
        raise NotImplementedError("Exercise 6.5: write TransformerBlock.forward")

    fails(check_transformer_block, block_with(blank), "not implemented", "Exercise 6.5")
