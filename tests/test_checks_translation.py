"""The chapter 5 checkers accept the reference and reject each classic bug with a targeted hint."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from checking import fails

from transformer_course.blocks import ACTIVATIONS, MLP, TransformerBlock, residual_sublayer
from transformer_course.checks.harness import CheckFailure
from transformer_course.checks.translation import (
    check_beam_search,
    check_encoder_decoder,
    check_greedy_decode,
    check_inverse_sqrt_lr,
    check_label_smoothing,
    check_mlp,
    check_positional_encoding,
    check_residual_sublayer,
    check_seq2seq_block,
    check_token_embedding,
)
from transformer_course.decoding import beam_search, greedy_decode
from transformer_course.encoder_decoder import (
    EncoderDecoderTransformer,
    TokenEmbedding,
    label_smoothed_cross_entropy,
    sinusoidal_positional_encoding,
)
from transformer_course.masking import causal_mask, combine_masks
from transformer_course.training import inverse_sqrt_lr


def blank(*args, **kwargs):
    raise NotImplementedError("the hint from the workbook")


@pytest.mark.parametrize(
    ("checker", "reference"),
    [
        (check_positional_encoding, sinusoidal_positional_encoding),
        (check_token_embedding, TokenEmbedding),
        (check_residual_sublayer, residual_sublayer),
        (check_seq2seq_block, TransformerBlock),
        (check_label_smoothing, label_smoothed_cross_entropy),
        (check_greedy_decode, greedy_decode),
    ],
)
def test_reference_passes(checker, reference, capsys):
    checker(reference)
    assert "passes every check" in capsys.readouterr().out


def test_blanks_fail_with_the_hint():
    for checker in (
        check_positional_encoding,
        check_residual_sublayer,
        check_label_smoothing,
        check_greedy_decode,
    ):
        with pytest.raises(CheckFailure, match="not implemented yet.*the hint from the workbook"):
            checker(blank)
    for checker, cls in (
        (check_token_embedding, TokenEmbedding),
        (check_seq2seq_block, TransformerBlock),
    ):
        with pytest.raises(CheckFailure, match="not implemented yet"):
            checker(type("Learner", (cls,), {"forward": blank}))


def test_independent_positional_encoding_passes():
    def loops(seq_len, d_model):
        return torch.tensor(
            [
                [
                    math.sin(p / 10000 ** (i / d_model))
                    if i % 2 == 0
                    else math.cos(p / 10000 ** ((i - 1) / d_model))
                    for i in range(d_model)
                ]
                for p in range(seq_len)
            ]
        )

    check_positional_encoding(loops)


def test_sin_cos_swapped_is_caught():
    def swapped(seq_len, d_model):
        pe = sinusoidal_positional_encoding(seq_len, d_model)
        return torch.stack([pe[:, 1::2], pe[:, 0::2]], dim=-1).flatten(
            -2
        )  # cos on even dims, sin on odd

    with pytest.raises(CheckFailure, match="sin and cos are swapped"):
        check_positional_encoding(swapped)


def test_concatenated_halves_are_caught():
    def halves(seq_len, d_model):
        pe = sinusoidal_positional_encoding(seq_len, d_model)
        return torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=-1)

    with pytest.raises(CheckFailure, match="interleaved"):
        check_positional_encoding(halves)


def test_missing_embedding_scale_is_caught():
    def forward(self, tokens):
        return self.W_E[tokens] + sinusoidal_positional_encoding(
            tokens.shape[-1], self.d_model, dtype=self.W_E.dtype
        )

    with pytest.raises(CheckFailure, match=r"forget the sqrt\(d_model\) embedding scale"):
        check_token_embedding(type("NoScale", (TokenEmbedding,), {"forward": forward}))


def test_scaling_the_positional_encoding_too_is_caught():
    def forward(self, tokens):
        pe = sinusoidal_positional_encoding(tokens.shape[-1], self.d_model, dtype=self.W_E.dtype)
        return (self.W_E[tokens] + pe) * math.sqrt(self.d_model)

    with pytest.raises(CheckFailure, match="scale only the token embedding"):
        check_token_embedding(type("ScalesAll", (TokenEmbedding,), {"forward": forward}))


def test_smoothing_over_the_other_tokens_only_is_caught():
    def other_tokens(logits, targets, *, smoothing, ignore_index):
        log_probs = logits.log_softmax(-1)
        target = torch.full_like(log_probs, smoothing / (logits.shape[-1] - 1))
        target.scatter_(-1, targets[..., None], 1 - smoothing)
        loss = -(target * log_probs).sum(-1)
        keep = targets != ignore_index
        return (loss * keep).sum() / keep.sum()

    with pytest.raises(CheckFailure, match="spread over all vocab tokens"):
        check_label_smoothing(other_tokens)


def test_padding_counted_in_the_loss_is_caught():
    def counts_padding(logits, targets, *, smoothing, ignore_index):
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), label_smoothing=smoothing
        )

    with pytest.raises(CheckFailure, match="ignore_index: the positions"):
        check_label_smoothing(counts_padding)


def test_greedy_decode_bugs_are_caught():
    def keeps_bos(model, src, *, bos_id, eos_id, max_new_tokens):
        return [
            [bos_id] + row
            for row in greedy_decode(
                model, src, bos_id=bos_id, eos_id=eos_id, max_new_tokens=max_new_tokens
            )
        ]

    with pytest.raises(CheckFailure, match="start token"):
        check_greedy_decode(keeps_bos)

    def ignores_max_new_tokens(model, src, *, bos_id, eos_id, max_new_tokens):
        return greedy_decode(
            model,
            src,
            bos_id=bos_id,
            eos_id=eos_id,
            max_new_tokens=min(max_new_tokens + 2, model.cfg.n_ctx),
        )

    with pytest.raises(CheckFailure, match="max_new_tokens=5"):
        check_greedy_decode(ignores_max_new_tokens)


# ---- families: train mode and dropout, optional arguments, rows that differ, numerics ----------


def test_dropout_in_the_wrong_place_or_left_on_in_eval_mode_is_caught():
    def before_positions(self, tokens):
        x = self.dropout(self.W_E[tokens] * math.sqrt(self.d_model))
        return x + sinusoidal_positional_encoding(tokens.shape[-1], self.d_model, dtype=x.dtype)

    with pytest.raises(CheckFailure, match="train mode, dropout on"):
        check_token_embedding(
            type("EarlyDropout", (TokenEmbedding,), {"forward": before_positions})
        )

    def always_dropout(self, tokens):
        x = self.W_E[tokens] * math.sqrt(self.d_model)
        pe = sinusoidal_positional_encoding(tokens.shape[-1], self.d_model, dtype=x.dtype)
        return torch.nn.functional.dropout(x + pe, self.dropout.p)  # training=True by default

    with pytest.raises(CheckFailure, match="eval mode"):
        check_token_embedding(type("AlwaysDropout", (TokenEmbedding,), {"forward": always_dropout}))


def test_softmax_then_log_is_caught_on_confident_logits():
    def softmax_log(logits, targets, *, smoothing=0.1, ignore_index=None):
        log_probs = logits.softmax(-1).log()
        nll = -log_probs.gather(-1, targets[..., None]).squeeze(-1)
        loss = (1 - smoothing) * nll + smoothing * -log_probs.mean(-1)
        keep = (
            torch.ones_like(targets, dtype=torch.bool)
            if ignore_index is None
            else targets != ignore_index
        )
        return (loss * keep).sum() / keep.sum()

    with pytest.raises(CheckFailure, match="log_softmax"):
        check_label_smoothing(softmax_log)


def test_an_ignore_index_that_must_be_given_is_caught():
    def needs_ignore_index(logits, targets, *, smoothing=0.1, ignore_index=None):
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1),
            targets.flatten(),
            label_smoothing=smoothing,
            ignore_index=ignore_index,
        )

    with pytest.raises(CheckFailure, match="ignore_index left at its default"):
        check_label_smoothing(needs_ignore_index)


def test_greedy_decoding_that_stops_with_the_first_finished_row_is_caught():
    def stops_early(model, src, *, bos_id, eos_id, max_new_tokens):
        memory, mask = model.encode(src), model.src_mask(src)
        ys = torch.full((src.shape[0], 1), bos_id)
        for _ in range(max_new_tokens):
            next_token = model.decode(ys, memory, mask)[:, -1].argmax(-1)
            if (next_token == eos_id).any():  # the bug: one finished row ends every row
                break
            ys = torch.cat([ys, next_token[:, None]], dim=1)
        return ys[:, 1:].tolist()

    with pytest.raises(CheckFailure, match="every row"):
        check_greedy_decode(stops_early)


def test_valid_alternatives_pass():
    """A loss written with `F.cross_entropy` and a greedy loop over rows one at a time."""

    def with_cross_entropy(logits, targets, *, smoothing=0.1, ignore_index=None):
        if ignore_index is not None and (targets == ignore_index).all():
            return logits.sum() * 0  # no position counts
        return torch.nn.functional.cross_entropy(
            logits.flatten(0, 1),
            targets.flatten(),
            label_smoothing=smoothing,
            ignore_index=-100 if ignore_index is None else ignore_index,
        )

    @torch.no_grad()
    def row_by_row(model, src, *, bos_id, eos_id, max_new_tokens):
        rows, was_training = [], model.training
        model.eval()
        for row in range(src.shape[0]):
            one = src[row : row + 1]
            memory, mask, ys = model.encode(one), model.src_mask(one), [bos_id]
            while len(ys) <= max_new_tokens:
                next_id = model.decode(torch.tensor([ys]), memory, mask)[0, -1].argmax().item()
                if next_id == eos_id:
                    break
                ys.append(next_id)
            rows.append(ys[1:])
        model.train(was_training)
        return rows

    check_label_smoothing(with_cross_entropy)
    check_greedy_decode(row_by_row)


# ---- new exercises: the encoder block, the assembled model, the schedule, beam search ----------


def test_new_references_pass(capsys):
    check_encoder_decoder(EncoderDecoderTransformer)
    check_inverse_sqrt_lr(inverse_sqrt_lr)
    check_beam_search(beam_search)
    assert capsys.readouterr().out.count("passes every check") == 3


def test_encoder_decoder_bugs_are_named():
    def no_final_norm(self, src):
        x = self.src_embed(src)
        for block in self.encoder:
            x = block(x, self.src_mask(src))
        return x

    with pytest.raises(CheckFailure, match="ln_enc"):
        check_encoder_decoder(
            type("NoFinalNorm", (EncoderDecoderTransformer,), {"encode": no_final_norm})
        )

    def causal_only(self, tgt, memory, src_mask):
        x = self.tgt_embed(tgt)
        for block in self.decoder:
            x = block(x, causal_mask(tgt.shape[1]), context=memory, context_mask=src_mask)
        if self.cfg.norm == "pre":
            x = self.ln_dec(x)
        W_U = self.tgt_embed.W_E.T if self.cfg.tie_embeddings else self.W_U
        return x @ W_U + self.b_U

    with pytest.raises(CheckFailure, match="target's padding is visible"):
        check_encoder_decoder(
            type("CausalOnly", (EncoderDecoderTransformer,), {"decode": causal_only})
        )

    def no_source_mask(self, tgt, memory, src_mask):
        return EncoderDecoderTransformer.decode(self, tgt, memory, None)

    with pytest.raises(CheckFailure, match="context_mask=src_mask"):
        check_encoder_decoder(
            type("NoSourceMask", (EncoderDecoderTransformer,), {"decode": no_source_mask})
        )


def test_schedule_bugs_are_named():
    with pytest.raises(CheckFailure, match="square root of the step"):
        check_inverse_sqrt_lr(
            lambda step, *, lr, warmup_steps: (
                lr * min((step + 1) / warmup_steps, warmup_steps / (step + 1))
            )
        )
    with pytest.raises(CheckFailure, match="steps count from 0"):
        check_inverse_sqrt_lr(
            lambda step, *, lr, warmup_steps: (
                lr * min(step / warmup_steps, math.sqrt(warmup_steps / max(step, 1)))
            )
        )


def test_beam_search_that_is_greedy_or_shares_beams_across_rows_is_caught():
    with pytest.raises(CheckFailure, match="greedy translations"):
        check_beam_search(
            lambda model, src, *, bos_id, eos_id, max_new_tokens, beam_size=4: greedy_decode(
                model, src, bos_id=bos_id, eos_id=eos_id, max_new_tokens=max_new_tokens
            )
        )

    def first_row_only(model, src, *, bos_id, eos_id, max_new_tokens, beam_size=4):
        best = beam_search(
            model,
            src[:1],
            bos_id=bos_id,
            eos_id=eos_id,
            max_new_tokens=max_new_tokens,
            beam_size=beam_size,
        )
        return best * src.shape[0]

    with pytest.raises(CheckFailure, match="its own beams"):
        check_beam_search(first_row_only)


@torch.no_grad()
def listed_beam_search(
    model,
    src,
    *,
    bos_id,
    eos_id,
    max_new_tokens=None,
    beam_size=4,
    length_penalty=0.6,
    max_len=None,
    bug="",
):
    """Beam search with Python lists, row by row; `bug` switches on one classic mistake."""
    if max_new_tokens is None:
        if max_len is None:
            raise ValueError("max_new_tokens: expected an int, got None")
        max_new_tokens = max_len
    power = {"raw sum": 0.0, "length itself": 1.0}.get(bug, length_penalty)
    rows, was_training = [], model.training
    model.eval()
    for row in src:
        memory, mask = model.encode(row[None]), model.src_mask(row[None])
        live, done = [([bos_id], 0.0)], []
        for step in range(max_new_tokens):
            candidates = []
            for ids, score in live:
                logits = model.decode(torch.tensor([ids]), memory, mask)[0, -1]
                for token, lp in enumerate(logits.float().log_softmax(-1).tolist()):
                    candidates.append((score + lp, ids, token))
            candidates = sorted(candidates, key=lambda c: -c[0])[: 2 * beam_size]
            live, length = [], step + (0 if bug == "length without </s>" else 1)
            for score, ids, token in candidates:
                if len(live) == beam_size and bug != "every </s> set aside":
                    break
                if token == eos_id:
                    done.append((score / max(length, 1) ** power, ids[1:]))
                elif len(live) < beam_size:
                    live.append((ids + [token], score))
            if len(done) >= beam_size or not live:
                break
        if not done and bug != "live beams left out":
            done = [(score / (len(ids) - 1) ** power, ids[1:]) for ids, score in live]
        rows.append(max(done, key=lambda d: d[0])[1] if done else [])
    model.train(was_training)
    return rows


def test_a_beam_search_written_with_lists_passes():
    check_beam_search(listed_beam_search)


@pytest.mark.parametrize(
    ("bug", "words"),
    [
        ("raw sum", ["an early </s>", "not by the raw sum"]),
        ("length itself", ["left at its default, 0.6", "not by the length itself"]),
        ("length without </s>", ["different lengths", "its tokens and its </s>"]),
        ("every </s> set aside", ["an unlikely </s>", "not set aside"]),
        ("live beams left out", ["no translation ends", "the live beams compete"]),
    ],
)
def test_beam_search_length_and_stopping_mistakes_are_named(bug, words):
    fails(check_beam_search, functools.partial(listed_beam_search, bug=bug), *words)


def test_beam_search_with_a_fixed_length_penalty_is_named():
    def fixed(model, src, **options):
        return listed_beam_search(model, src, **{**options, "length_penalty": 0.6})

    fails(check_beam_search, fixed, "length_penalty=1.0", "not a fixed exponent")


def test_decoding_without_any_length_is_refused():
    def loops(model, src, *, bos_id, eos_id, max_new_tokens=None, max_len=None, **options):
        steps = max_new_tokens or max_len or model.cfg.n_ctx  # None read as "up to n_ctx"
        return greedy_decode(model, src, bos_id=bos_id, eos_id=eos_id, max_new_tokens=steps)

    fails(check_greedy_decode, loops, "max_len=None", "refuse it with a ValueError")


# ---- the residual sublayer --------------------------------------------------------------------


def sublayer_with(**wrong):
    """A residual sublayer with one thing `wrong`; with nothing wrong, a valid rewrite."""

    def residual(resid, sublayer, ln, *, norm, dropout, hook_out):
        pre = norm == "pre"
        if wrong.get("swap"):
            pre = not pre
        pre = pre or wrong.get("always_pre", False)
        stream = ln(resid) if wrong.get("normed_stream") else resid
        drop = (lambda t: t) if wrong.get("no_dropout") else dropout
        hook = hook_out
        if wrong.get("hook_before_dropout"):
            out = drop(hook_out(sublayer(ln(resid) if pre else resid)))
        elif wrong.get("hook_result_ignored"):
            out = drop(sublayer(ln(resid) if pre else resid))
            hook(out)
        else:
            out = hook(drop(sublayer(ln(resid) if pre else resid)))
        if wrong.get("dropout_on_sum"):
            return dropout(torch.add(stream, out)) if pre else dropout(ln(torch.add(resid, out)))
        if pre:
            return torch.add(stream, out)
        if wrong.get("norm_before_add"):
            return ln(resid) + out
        return ln(torch.add(resid, out))

    return residual


@pytest.mark.parametrize(
    ("wrong", "words"),
    [
        ({"norm_before_add": True}, "the norm comes before the residual add here"),
        ({"swap": True}, "this is post-LN"),
        ({"always_pre": True}, r"norm='post'\)(.|\n)*this is pre-LN"),
        ({"normed_stream": True}, "add its output to resid itself"),
        ({"hook_before_dropout": True}, "before dropout"),
        ({"hook_result_ignored": True}, "add what hook_out returns"),
        ({"no_dropout": True}, "apply dropout once, to the sublayer's output"),
        ({"dropout_on_sum": True}, "apply dropout once, to the sublayer's output"),
    ],
)
def test_residual_sublayer_bugs_are_named(wrong, words):
    with pytest.raises(CheckFailure, match=words):
        check_residual_sublayer(sublayer_with(**wrong))


def test_residual_sublayer_alternatives_pass(capsys):
    """Branches written out with `torch.add`, and computing `out` once before the branch."""
    check_residual_sublayer(sublayer_with())

    def out_first(resid, sublayer, ln, *, norm, dropout, hook_out):
        out = hook_out(dropout(sublayer(ln(resid) if norm == "pre" else resid)))
        return resid + out if norm == "pre" else ln(resid + out)

    check_residual_sublayer(out_first)
    assert capsys.readouterr().out.count("passes every check") == 2


# ---- the encoder's and the decoder's block ----------------------------------------------------


def block_forward(self, resid, mask=None, context=None, context_mask=None, cache=None, **wrong):
    """The block written out without `residual_sublayer` (a valid alternative: the causal mask
    built by hand), with one thing `wrong` at a time."""
    causal = self.causal != (
        wrong.get("flip_causal", False)
        or wrong.get("decoder_not_causal", False)
        and self.cross_attention
    )
    self_mask = combine_masks(causal_mask(resid.shape[1]), mask) if causal else mask
    if wrong.get("no_mask"):
        self_mask = causal_mask(resid.shape[1]) if causal else None

    def sublayer(r, fn, ln, hook, dropout=self.dropout, stream=None):
        stream = r if stream is None else stream  # what the sublayer's output is added to
        if self.norm == "pre":
            return stream + hook(dropout(fn(ln(r))))
        return ln(stream + hook(dropout(fn(r))))

    def self_attention(r):
        attend = lambda h: self.attn(h, mask=self_mask)
        if cache is not None and not wrong.get("drop_cache"):  # the queries are the last positions
            attend = lambda h: self.attn(h, mask=mask, causal=causal, cache=cache)
        stream = self.ln1(r) if wrong.get("normed_stream") else r
        return self.hook_resid_mid(sublayer(r, attend, self.ln1, self.hook_attn_out, stream=stream))

    def cross_attention(r):
        kv_mask = None if wrong.get("no_context_mask") else context_mask
        ln = self.ln2 if wrong.get("mlp_norm_for_cross") else self.ln_cross
        hook = (lambda t: t) if wrong.get("no_cross_hook") else self.hook_cross_attn_out
        dropout = (lambda t: t) if wrong.get("no_cross_dropout") else self.dropout
        if wrong.get("queries_from_context"):
            attend = lambda h: self.cross_attn(context, h)
        else:
            attend = lambda h: self.cross_attn(h, context, mask=kv_mask)
        return self.hook_resid_mid_cross(sublayer(r, attend, ln, hook, dropout))

    steps = [self_attention]
    if self.cross_attention and not wrong.get("no_cross"):
        steps = (
            [cross_attention, self_attention]
            if wrong.get("cross_first")
            else [self_attention, cross_attention]
        )
    resid = self.hook_resid_pre(resid)
    for step in steps:
        resid = step(resid)
    return self.hook_resid_post(sublayer(resid, self.mlp, self.ln2, self.hook_mlp_out))


def block_with(**wrong):
    def forward(self, resid, mask=None, context=None, context_mask=None, *, cache=None):
        return block_forward(self, resid, mask, context, context_mask, cache, **wrong)

    return type("LearnerBlock", (TransformerBlock,), {"forward": forward})


@pytest.mark.parametrize(
    ("wrong", "words"),
    [
        ({"flip_causal": True}, "not causal: pass causal=self.causal"),
        ({"no_mask": True}, "the padding is visible"),
        ({"no_cross": True}, "cross-attention sublayer is missing"),
        ({"no_context_mask": True}, "ignores the source padding"),
        ({"mlp_norm_for_cross": True}, "not self.ln2"),
        ({"queries_from_context": True}, "Queries come from the stream"),
        ({"decoder_not_causal": True}, "must be causal"),
        ({"cross_first": True}, "self-attention, then cross-attention, then the MLP"),
        ({"no_cross_hook": True}, "hook_cross_attn_out"),
        ({"no_cross_dropout": True}, "dropout=0.3"),
        ({"drop_cache": True}, "pass `cache` on to the self-attention"),
        ({"normed_stream": True}, "only the sublayer's input is normalised, not the stream"),
    ],
)
def test_seq2seq_block_bugs_are_named(wrong, words):
    with pytest.raises(CheckFailure, match=words):
        check_seq2seq_block(block_with(**wrong))


def test_a_block_written_without_residual_sublayer_passes(capsys):
    check_seq2seq_block(block_with())
    assert "passes every check" in capsys.readouterr().out


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


def test_padding_counted_only_in_the_denominator_names_ignore_index():
    def zeroed_but_counted(logits, targets, *, smoothing=0.1, ignore_index=None):
        loss = label_smoothed_cross_entropy(logits, targets, smoothing=smoothing) * 0
        log_probs = logits.log_softmax(-1)
        kept = targets != ignore_index if ignore_index is not None else torch.ones_like(targets)
        nll = -log_probs.gather(-1, targets[..., None]).squeeze(-1)
        loss = loss + ((1 - smoothing) * nll + smoothing * -log_probs.mean(-1)) * kept
        return loss.sum() / targets.numel()

    fails(check_label_smoothing, zeroed_but_counted, "ignore_index: the positions")


def test_label_smoothing_that_divides_by_zero_on_an_all_padding_batch_is_caught():
    def zero_over_zero(logits, targets, *, smoothing=0.1, ignore_index=None):
        return F.cross_entropy(
            logits.flatten(0, 1),
            targets.flatten(),
            label_smoothing=smoothing,
            ignore_index=-100 if ignore_index is None else ignore_index,
        )

    fails(check_label_smoothing, zero_over_zero, "every target is ignore_index", "its loss is 0")


def test_schedule_that_divides_by_a_zero_warmup_is_caught():
    def divides(step, *, lr, warmup_steps):
        n = step + 1
        return lr * min(n / warmup_steps, math.sqrt(warmup_steps / n))

    fails(check_inverse_sqrt_lr, divides, "warmup_steps=0", "ZeroDivisionError", "no warmup")


def test_encoder_decoder_without_its_id_checks_is_caught():
    def unchecked(self, src):
        x = self.src_embed(src)
        for block in self.encoder:
            x = block(x, self.src_mask(src))
        return self.ln_enc(x) if self.cfg.norm == "pre" else x

    fails(
        check_encoder_decoder,
        type("Unchecked", (EncoderDecoderTransformer,), {"encode": unchecked}),
        "a source id -1",
        "validate.token_tensor",
    )
