"""The chapter-6 checkers: the reference passes, a blank fails with its hint, classic bugs get
targeted hints (each bug is written out here as a small variant of the reference)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_course.blocks import ACTIVATIONS, MLP, TransformerBlock
from transformer_course.checks import CheckFailure
from transformer_course.checks.gpt2 import (
    check_embed,
    check_generate,
    check_gpt2_forward,
    check_mlp,
    check_pos_embed,
    check_top_p_filter,
    check_train_step,
    check_transformer_block,
    check_unembed,
)
from transformer_course.gpt2 import GPT2, Embed, PosEmbed, Unembed, generate, top_p_filter, train_step
from transformer_course.masking import causal_mask, combine_masks


def fails(check, candidate, *words: str) -> None:
    with pytest.raises(CheckFailure) as info:
        check(candidate)
    message = str(info.value)
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in: {message}"


@pytest.mark.parametrize(
    "check, reference",
    [
        (check_embed, Embed),
        (check_pos_embed, PosEmbed),
        (check_unembed, Unembed),
        (check_mlp, MLP),
        (check_gpt2_forward, GPT2),
        (check_generate, generate),
    ],
)
def test_reference_passes(check, reference, capsys):
    check(reference)
    assert "passes every check" in capsys.readouterr().out


# Blanks: what the exercise workbook hands out.


class BlankEmbed(Embed):
    def forward(self, tokens):
        raise NotImplementedError("index W_E with the tokens")


class BlankPosEmbed(PosEmbed):
    def forward(self, tokens):
        raise NotImplementedError("slice W_pos to the sequence length")


class BlankUnembed(Unembed):
    def __init__(self, cfg):
        raise NotImplementedError("create W_U and b_U")


class BlankMLP(MLP):
    def forward(self, x):
        raise NotImplementedError("widen, gelu_new, project back")


class BlankGPT2(GPT2):
    def forward(self, tokens):
        raise NotImplementedError("embed, blocks, ln_final, unembed")


def blank_generate(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
    raise NotImplementedError("loop: crop, forward, last logits, sample, append")


@pytest.mark.parametrize(
    "check, blank, hint",
    [
        (check_embed, BlankEmbed, "index W_E"),
        (check_pos_embed, BlankPosEmbed, "slice W_pos"),
        (check_unembed, BlankUnembed, "create W_U"),
        (check_mlp, BlankMLP, "widen"),
        (check_gpt2_forward, BlankGPT2, "ln_final"),
        (check_generate, blank_generate, "crop"),
    ],
)
def test_blank_fails_with_its_hint(check, blank, hint):
    fails(check, blank, "not implemented", hint)


# Bugs.


class ScaledEmbed(Embed):
    def forward(self, tokens):
        return self.W_E[tokens] * math.sqrt(self.cfg.d_model)


def test_embed_rejects_vaswani_scale():
    fails(check_embed, ScaledEmbed, "sqrt(d_model)")


class PosEmbedByToken(PosEmbed):
    def forward(self, tokens):
        return self.W_pos[tokens]


class PosEmbedNoBatch(PosEmbed):
    def forward(self, tokens):
        return self.W_pos[: tokens.shape[1]]


def test_pos_embed_rejects_indexing_by_token_and_missing_batch():
    fails(check_pos_embed, PosEmbedByToken, "not on which token")
    fails(check_pos_embed, PosEmbedNoBatch, "shape")


class UnembedBiasOnes(Unembed):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.b_U = nn.Parameter(torch.ones(cfg.d_vocab))  # the catalogue's "biases initialised to ones"


class UnembedNoBias(Unembed):
    def forward(self, x):
        return x @ self.W_U


class UnembedTransposed(Unembed):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.W_U = nn.Parameter(torch.randn(cfg.d_vocab, cfg.d_model) * cfg.init_range)


def test_unembed_rejects_bias_ones_missing_bias_and_wrong_layout():
    fails(check_unembed, UnembedBiasOnes, "zeros")
    fails(check_unembed, UnembedNoBias, "bias")
    fails(check_unembed, UnembedTransposed, "shape")


class ExactGeluMLP(MLP):
    def forward(self, x):
        return F.gelu(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


class ReluMLP(MLP):
    def forward(self, x):
        return F.relu(x @ self.W_in + self.b_in) @ self.W_out + self.b_out


def test_mlp_rejects_wrong_activation():
    fails(check_mlp, ExactGeluMLP, "tanh")
    fails(check_mlp, ReluMLP, "relu")


class NoPositionGPT2(GPT2):
    def forward(self, tokens):
        residual = self.embed(tokens)
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))


class NoFinalNormGPT2(GPT2):
    def forward(self, tokens):
        residual = self.embed(tokens) + self.pos_embed(tokens)
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(residual)


def test_gpt2_forward_rejects_missing_parts():
    fails(check_gpt2_forward, NoPositionGPT2, "position embedding")
    fails(check_gpt2_forward, NoFinalNormGPT2, "ln_final")


def _sampler(pick_logits, *, crop=True, temperature_op=lambda logits, t: logits / t, top_k_largest=True, greedy=False):
    """A generate() with one knob turned wrong at a time."""

    @torch.no_grad()
    def sample(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            context = tokens[:, -model.cfg.n_ctx :] if crop else tokens
            logits = pick_logits(model(context))
            if temperature == 0 or greedy:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = temperature_op(logits, temperature)
                if top_k is not None:
                    values = logits.topk(top_k, dim=-1, largest=top_k_largest).values[:, -1:]
                    drop = logits < values if top_k_largest else logits > values
                    logits = logits.masked_fill(drop, -math.inf)
                next_token = torch.multinomial(logits.softmax(-1), 1)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    return sample


def last(logits):
    return logits[:, -1]


def test_generate_rejects_classic_sampling_bugs():
    fails(check_generate, _sampler(last, crop=False), "n_ctx")
    fails(check_generate, _sampler(lambda logits: logits[:, 0]), "last position")
    fails(check_generate, _sampler(last, temperature_op=lambda logits, t: logits * t), "divide")
    fails(check_generate, _sampler(last, greedy=True), "instead of taking the argmax")
    fails(check_generate, _sampler(last, top_k_largest=False), "top_k")


def test_generate_rejects_division_by_zero_temperature():
    @torch.no_grad()
    def divides(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            probs = (model(tokens[:, -model.cfg.n_ctx :])[:, -1] / temperature).softmax(-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1)], dim=1)
        return tokens

    fails(check_generate, divides, "greedy")


# Families: hooks, optional arguments, dropout in train and eval mode, rows that differ.


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


class UnhookedGPT2(GPT2):
    def forward(self, tokens):
        residual = self.dropout(self.embed(tokens) + self.pos_embed(tokens))
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))


class LateDropoutGPT2(GPT2):
    def forward(self, tokens):
        residual = self.hook_embed(self.embed(tokens)) + self.hook_pos_embed(self.pos_embed(tokens))
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(self.dropout(residual)))


def test_gpt2_forward_rejects_missing_hooks_and_misplaced_dropout():
    fails(check_gpt2_forward, UnhookedGPT2, "hook_embed", "never received")
    fails(check_gpt2_forward, LateDropoutGPT2, "train mode", "before the blocks")


def test_generate_rejects_a_top_k_threshold_taken_from_the_first_row():
    @torch.no_grad()
    def first_row_threshold(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -model.cfg.n_ctx :])[:, -1]
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    threshold = logits[0].topk(top_k).values[-1]  # the bug: row 0's k-th largest
                    logits = logits.masked_fill(logits < threshold, -math.inf)
                next_token = torch.multinomial(logits.softmax(-1), 1)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    fails(check_generate, first_row_threshold, "four different prompts", "each row")


def test_generate_alternatives_pass():
    """Top-k by scattering the kept logits into -inf, and sampling with a Gumbel-max trick."""

    @torch.no_grad()
    def scatter_gumbel(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, generator=None):
        for _ in range(max_new_tokens):
            logits = model(tokens[:, -model.cfg.n_ctx :])[:, -1]
            if temperature == 0:
                next_token = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    values, indices = logits.topk(top_k, dim=-1)
                    logits = torch.full_like(logits, -math.inf).scatter(-1, indices, values)
                if top_p is not None:
                    logits = top_p_filter(logits, top_p)
                uniform = torch.rand(logits.shape, generator=generator)
                gumbel = -torch.log(-torch.log(uniform))
                next_token = (logits + gumbel).argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
        return tokens

    check_generate(scatter_gumbel)


def test_generate_rejects_an_ignored_generator():
    @torch.no_grad()
    def global_rng(model, tokens, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, generator=None):
        return generate(model, tokens, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)

    fails(check_generate, global_rng, "same generator seed", "generator=generator")


# The transformer block.


def block_with(forward):
    return type("LearnerBlock", (TransformerBlock,), {"forward": forward})


def _sublayers(self, resid, mask, *, causal=True, pre_ln=True, keep_stream=True, residual=True, drop=True):
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
    fails(check_transformer_block, block_with(lambda self, resid, mask=None: _sublayers(self, resid, mask, **knob)),
          *words)


def test_transformer_block_that_ignores_its_mask_or_hooks_is_caught():
    fails(check_transformer_block, block_with(lambda self, resid, mask=None: _sublayers(self, resid, None)),
          "a padding mask", "ignored")

    def unhooked(self, resid, mask=None):
        mask = combine_masks(causal_mask(resid.shape[1]), mask)
        resid = resid + self.dropout(self.attn(self.ln1(resid), mask=mask))
        return resid + self.dropout(self.mlp(self.ln2(resid)))

    fails(check_transformer_block, block_with(unhooked), "hook_resid_pre", "never received")


def test_transformer_block_reference_and_blank():
    check_transformer_block(TransformerBlock)

    def blank(self, resid, mask=None):
        raise NotImplementedError("Exercise 6.5: write TransformerBlock.forward")

    fails(check_transformer_block, block_with(blank), "not implemented", "Exercise 6.5")


# Top-p filtering and the training step.


def test_top_p_filter_and_train_step_references_pass(capsys):
    check_top_p_filter(top_p_filter)
    check_train_step(train_step)
    assert capsys.readouterr().out.count("passes every check") == 2


def test_top_p_filter_bugs_are_named():
    def drops_the_crossing_token(logits, top_p):
        probs, order = logits.softmax(-1).sort(-1, descending=True)
        drop = probs.cumsum(-1) > top_p
        return logits.masked_fill(drop.scatter(-1, order, drop), -math.inf)

    fails(check_top_p_filter, drops_the_crossing_token, "mass *before* it")

    def stays_sorted(logits, top_p):
        probs, order = logits.softmax(-1).sort(-1, descending=True)
        return logits.masked_fill(probs.cumsum(-1) - probs >= top_p, -math.inf)  # mask in sorted order

    fails(check_top_p_filter, stays_sorted, "scatter the mask")

    def renormalises(logits, top_p):
        return top_p_filter(logits, top_p).log_softmax(-1)

    fails(check_top_p_filter, renormalises, "kept logits unchanged")


def test_top_p_filter_alternative_passes():
    def with_a_loop(logits, top_p):
        out = torch.full_like(logits, -math.inf)
        for row in range(logits.shape[0]):
            probs = logits[row].softmax(-1)
            total = 0.0
            for index in probs.argsort(descending=True).tolist():
                if total >= top_p:
                    break
                out[row, index], total = logits[row, index], total + probs[index].item()
        return out

    check_top_p_filter(with_a_loop)


def _step(*, train=True, zero=True, clip=True, item=True):
    def step(model, optimizer, tokens, targets, *, grad_clip=1.0):
        if train:
            model.train()
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
        if zero:
            optimizer.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        return loss.item() if item else loss

    return step


@pytest.mark.parametrize(
    ("bug", "words"),
    [({"train": False}, ["model.train()"]), ({"zero": False}, ["zero_grad"]),
     ({"clip": False}, ["clip_grad_norm_"]), ({"item": False}, ["loss.item()"])],
)
def test_train_step_bugs_are_named(bug, words):
    fails(check_train_step, _step(**bug), *words)


def test_train_step_alternative_passes():
    check_train_step(_step())
