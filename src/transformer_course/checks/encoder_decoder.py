"""Checkers for chapter 5: positional encoding, the scaled embedding, the residual sublayer, the
encoder's and decoder's block, the assembled model, label smoothing, the learning-rate schedule,
greedy decoding and beam search.

Each checker runs the learner's code next to the course's reference in float64. When the two
differ, it compares the learner's output with the classic mistakes (sin and cos swapped, the
missing sqrt(d_model) scale, post-LN's norm before the residual add, an unmasked decoder, ...)
and names the one that matches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_course.blocks import TransformerBlock, residual_sublayer
from transformer_course.checks import (
    CheckFailure,
    call,
    expect,
    expect_close,
    expect_hooks,
    expect_same_in_train_mode,
    load_reference_weights,
    passed,
)
from transformer_course.decoding import greedy_decode
from transformer_course.encoder_decoder import (
    EncoderDecoderTransformer,
    Seq2SeqConfig,
    TokenEmbedding,
    sinusoidal_positional_encoding,
)
from transformer_course.layernorm import LayerNorm
from transformer_course.masking import padding_mask
from transformer_course.training import inverse_sqrt_lr

__all__ = [
    "check_beam_search",
    "check_encoder_decoder",
    "check_greedy_decode",
    "check_inverse_sqrt_lr",
    "check_label_smoothing",
    "check_positional_encoding",
    "check_residual_sublayer",
    "check_seq2seq_block",
    "check_token_embedding",
]


def _raise_for_known_mistake(
    actual: Tensor, mistakes: dict[str, Tensor], name: str, atol: float = 1e-6
) -> None:
    """Raise a `CheckFailure` naming the first classic mistake `actual` matches (else return)."""
    for hint, wrong in mistakes.items():
        if wrong.shape == actual.shape and torch.allclose(
            actual.detach().double(), wrong.double(), atol=atol
        ):
            raise CheckFailure(f"`{name}`: values differ from the reference.\nHint: {hint}")


def _differs(actual: object, expected: Tensor, atol: float = 1e-6) -> bool:
    """A tensor of the expected shape whose values are not the expected ones."""
    return (
        isinstance(actual, Tensor)
        and actual.shape == expected.shape
        and not torch.allclose(actual.detach().double(), expected.double(), atol=atol)
    )


def check_positional_encoding(fn: Callable[[int, int], Tensor]) -> None:
    """`fn(seq_len, d_model)` must return the sinusoidal table of Vaswani et al., shape
    (seq_len, d_model)."""
    name = "sinusoidal_positional_encoding"
    for seq_len, d_model in ((7, 4), (50, 16)):
        actual = call(name, fn, seq_len, d_model)
        expected = sinusoidal_positional_encoding(seq_len, d_model, dtype=torch.float64)
        if _differs(actual, expected, atol=1e-5):
            _raise_for_known_mistake(actual, _pe_mistakes(seq_len, d_model), name, atol=1e-5)
        expect_close(
            actual.double() if isinstance(actual, Tensor) else actual,
            expected,
            name,
            "PE[pos, 2i] = sin(pos / 10000^(2i/d_model)) and "
            "PE[pos, 2i+1] = cos(pos / 10000^(2i/d_model)).",
            atol=1e-5,
        )
    passed(name)


def _pe_mistakes(seq_len: int, d_model: int) -> dict[str, Tensor]:
    position = torch.arange(seq_len, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angles = position / 10000 ** (two_i / d_model)

    def interleave(even: Tensor, odd: Tensor) -> Tensor:
        return torch.stack([even, odd], dim=-1).flatten(-2)

    per_dim = position / 10000 ** (torch.arange(d_model, dtype=torch.float64) / d_model)
    swapped = interleave(torch.cos(angles), torch.sin(angles))
    halves = torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1)
    per_dim_frequency = interleave(torch.sin(per_dim[:, 0::2]), torch.cos(per_dim[:, 1::2]))
    from_one = angles + 1 / 10000 ** (two_i / d_model)
    multiplied = position * 10000 ** (two_i / d_model)
    return {
        "sin and cos are swapped: even dimensions 2i get sin, odd ones 2i+1 get cos.": swapped,
        "sin and cos should be interleaved (sin in dims 0, 2, 4, ...; cos in dims 1, 3, 5, ...), "
        "not the sines in the first half and the cosines in the second.": halves,
        "the exponent is 2i/d_model, where 2i is the even dimension of the pair: dims 2i and 2i+1 "
        "share one frequency.": per_dim_frequency,
        "positions start at 0: the first row is sin(0) = 0 and cos(0) = 1.": interleave(
            torch.sin(from_one), torch.cos(from_one)
        ),
        "divide the position by 10000^(2i/d_model); multiplying by it gives huge angles.": (
            interleave(torch.sin(multiplied), torch.cos(multiplied))
        ),
    }


def check_token_embedding(cls: type) -> None:
    """`cls(d_vocab, d_model, dropout)` must return W_E[tokens] * sqrt(d_model) + PE."""
    name = "TokenEmbedding"
    vocab, d_model = 11, 16
    torch.manual_seed(0)
    theirs = call(name, cls, vocab, d_model, 0.0)
    expect(hasattr(theirs, "W_E"), name, "expected a parameter `W_E` of shape (vocab, d_model).")
    ours = TokenEmbedding(vocab, d_model, 0.0).double()
    with torch.no_grad():
        theirs.W_E.data = ours.W_E.detach().clone()
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    actual = call(f"{name}.forward", theirs, tokens)
    expected = ours(tokens)
    looked_up = ours.W_E[tokens]
    pe = sinusoidal_positional_encoding(5, d_model, dtype=torch.float64)
    scale = math.sqrt(d_model)
    mistakes = {
        "did you forget the sqrt(d_model) embedding scale? Multiply W_E[tokens] by sqrt(d_model) "
        "before adding the positional encoding.": looked_up + pe,
        "the embedding is divided by sqrt(d_model); multiply by it instead.": looked_up / scale
        + pe,
        "scale only the token embedding by sqrt(d_model), not the sum with the positional "
        "encoding.": (looked_up + pe) * scale,
        "the positional encoding is missing: add PE[:pos] to the scaled embedding.": looked_up
        * scale,
        "scale by sqrt(d_model), not by d_model.": looked_up * d_model + pe,
    }
    if _differs(actual, expected):
        _raise_for_known_mistake(actual, mistakes, name)
    expect_close(
        actual,
        expected.detach(),
        name,
        "return W_E[tokens] * sqrt(d_model) + PE[:pos], then dropout.",
        atol=1e-6,
    )

    theirs = call(name, cls, vocab, d_model, 0.5).double()
    ours = TokenEmbedding(vocab, d_model, 0.5).double()
    theirs.load_state_dict(ours.state_dict())
    expect_same_in_train_mode(
        f"{name}(dropout=0.5)",
        theirs,
        ours,
        tokens,
        hint="apply self.dropout once, to the sum of the scaled embedding and the positional "
        "encoding.",
    )
    passed(name)


def _noisy(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Random offsets on every parameter (layer-norm gains and biases included), so a sublayer
    or a norm in the wrong place changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return module


# The residual sublayer ----------------------------------------------------------------------


def _identity(t: Tensor) -> Tensor:
    return t


def _sublayer_setup(seed: int) -> tuple[Tensor, Callable[[Tensor], Tensor], LayerNorm]:
    """A residual stream far from zero mean and unit variance (so normalising it shows), a
    nonlinear stand-in sublayer, and a layer norm with random gains and biases."""
    generator = torch.Generator().manual_seed(seed)
    resid = 3 * torch.randn(2, 5, 16, generator=generator, dtype=torch.float64) + 1
    weight = torch.randn(16, 16, generator=generator, dtype=torch.float64) / 4
    ln = _noisy(LayerNorm(16).double(), seed)
    return resid, lambda x: 2 * torch.tanh(x @ weight), ln


def _sublayer_mistakes(resid: Tensor, f: Callable, ln: LayerNorm, norm: str) -> dict[str, Tensor]:
    normed, of_normed, of_resid = ln(resid), f(ln(resid)), f(resid)
    if norm == "pre":
        return {
            "this is post-LN; with norm='pre' normalise the sublayer's input and leave the stream "
            "as it is: resid + dropout(sublayer(ln(resid))).": ln(resid + of_resid),
            "only the sublayer's input is normalised: add its output to resid itself, not to "
            "ln(resid).": normed + of_normed,
            "pre-LN normalises the sublayer's input, not its output: sublayer(ln(resid)).": (
                resid + ln(of_resid)
            ),
            "the residual connection is missing: add the sublayer's output to resid.": of_normed,
            "the layer norm is missing: pre-LN feeds ln(resid) to the sublayer.": resid + of_resid,
        }
    return {
        "this is pre-LN; with norm='post' normalise the sum, after the residual add: "
        "ln(resid + dropout(sublayer(resid))).": resid + of_normed,
        "post-LN normalises the sum: ln(resid + out), not ln(resid) + out; the norm comes after "
        "the residual add.": normed + of_resid,
        "post-LN normalises the sum, not the sublayer's output: ln(resid + out).": (
            resid + ln(of_resid)
        ),
        "with post-LN the sublayer reads resid itself; only the sum is normalised.": (
            ln(resid + of_normed)
        ),
        "the residual connection is missing: normalise resid + out, not out alone.": ln(of_resid),
        "the layer norm is missing: post-LN returns ln(resid + out).": resid + of_resid,
    }


def _record(seen: list[Tensor], replace: Tensor | None = None) -> Callable[[Tensor], Tensor]:
    """A stand-in for a hook point: records what it receives, returns it (or `replace`)."""

    def hook(t: Tensor) -> Tensor:
        seen.append(t.detach())
        return t if replace is None else replace

    return hook


def check_residual_sublayer(fn: Callable[..., Tensor]) -> None:
    """`fn(resid, sublayer, ln, *, norm, dropout, hook_out)`: pre-LN
    `resid + dropout(sublayer(ln(resid)))`, post-LN `ln(resid + dropout(sublayer(resid)))`,
    with `hook_out` seeing (and able to replace) what is added."""
    name = "residual_sublayer"
    resid, f, ln = _sublayer_setup(seed=7)
    for norm in ("pre", "post"):
        where = f"{name}(norm={norm!r})"
        expected = residual_sublayer(resid, f, ln, norm=norm, dropout=_identity, hook_out=_identity)
        seen: list[Tensor] = []
        with torch.no_grad():
            actual = call(
                where, fn, resid, f, ln, norm=norm, dropout=_identity, hook_out=_record(seen)
            )
            if _differs(actual, expected):
                _raise_for_known_mistake(actual, _sublayer_mistakes(resid, f, ln, norm), where)
        form = "resid + out" if norm == "pre" else "ln(resid + out)"
        expect_close(actual, expected, where, f"with out = dropout(sublayer(...)), return {form}.")
        added = f(ln(resid)) if norm == "pre" else f(resid)
        expect(
            len(seen) == 1,
            f"{where}, hook_out",
            f"hook_out was called {len(seen)} times.",
            "pass the sublayer's output through hook_out once, before adding it to resid.",
        )
        expect(
            torch.allclose(seen[0], added, atol=1e-8),
            f"{where}, hook_out",
            "received a tensor that differs from what the sublayer adds to the stream.",
            "hook_out gets the sublayer's output after dropout, not the stream or the sum.",
        )
        with torch.no_grad():
            patched = call(
                where,
                fn,
                resid,
                f,
                ln,
                norm=norm,
                dropout=_identity,
                hook_out=_record([], torch.zeros_like(resid)),
            )
        expect_close(
            patched,
            resid if norm == "pre" else ln(resid),
            f"{where}, a patching hook",
            "add what hook_out returns (a hook may replace the tensor), not the tensor "
            "you passed to it.",
            atol=1e-8,
        )
        _expect_sublayer_dropout(fn, where, resid, f, ln, norm)
    passed(name)


def _expect_sublayer_dropout(fn, where, resid, f, ln, norm) -> None:
    """In train mode, under one seed, the learner's dropout falls where the reference's does,
    and hook_out sees the tensor after dropout."""
    dropout = torch.nn.Dropout(0.5).train()
    wanted: list[Tensor] = []
    seen: list[Tensor] = []
    with torch.no_grad():
        torch.manual_seed(1234)
        expected = residual_sublayer(
            resid, f, ln, norm=norm, dropout=dropout, hook_out=_record(wanted)
        )
        torch.manual_seed(1234)
        actual = call(where, fn, resid, f, ln, norm=norm, dropout=dropout, hook_out=_record(seen))
    where = f"{where}, dropout=0.5 in train mode"
    hint = "apply dropout once, to the sublayer's output, before hook_out and the residual add."
    expect_close(actual, expected, where, hint, atol=1e-8)
    expect(
        len(seen) == 1 and torch.allclose(seen[0], wanted[0], atol=1e-8),
        f"{where}, hook_out",
        "received the sublayer's output before dropout.",
        "hook_out gets what is added to the stream: the output after dropout.",
    )


# The encoder's and the decoder's block ------------------------------------------------------

BLOCK_HOOKS = {
    "hook_resid_pre": "pass the incoming residual stream through self.hook_resid_pre first.",
    "hook_attn_out": "give residual_sublayer hook_out=self.hook_attn_out for self-attention.",
    "hook_resid_mid": "hook_resid_mid gets the stream after the self-attention sublayer.",
    "hook_mlp_out": "give residual_sublayer hook_out=self.hook_mlp_out for the MLP.",
    "hook_resid_post": "hook_resid_post gets the block's output.",
}
CROSS_HOOKS = {
    "hook_cross_attn_out": "give residual_sublayer hook_out=self.hook_cross_attn_out for the "
    "cross-attention.",
    "hook_resid_mid_cross": "hook_resid_mid_cross gets the stream after the cross-attention "
    "sublayer.",
}


def _block_inputs() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A target stream with padding in row 1, an encoder output of another length (so queries
    and keys cannot be swapped unnoticed) and its padding mask."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 16, generator=generator, dtype=torch.float64)
    context = torch.randn(2, 4, 16, generator=generator, dtype=torch.float64)
    mask = padding_mask(torch.tensor([[3, 4, 5, 6, 7], [3, 4, 5, 0, 0]]), 0)
    context_mask = padding_mask(torch.tensor([[3, 4, 5, 6], [3, 4, 0, 0]]), 0)
    return x, mask, context, context_mask


def _block_run(block: TransformerBlock, inputs: dict[str, Tensor | None], **wrong) -> Tensor:
    """The reference block's forward pass built from its own parts, with one thing `wrong`:
    an input replaced (`mask`, `context`, `context_mask`) or a step changed."""
    inputs = {**inputs, **{k: v for k, v in wrong.items() if k in inputs}}
    causal, norm = wrong.get("causal", block.causal), wrong.get("norm", block.norm)
    norm_and_dropout = dict(norm=norm, dropout=_identity, hook_out=_identity)

    def self_attention(r: Tensor) -> Tensor:
        attend = lambda h: block.attn(h, mask=inputs["mask"], causal=causal)
        return residual_sublayer(r, attend, block.ln1, **norm_and_dropout)

    def cross_attention(r: Tensor) -> Tensor:
        attend = lambda h: block.cross_attn(h, inputs["context"], mask=inputs["context_mask"])
        return residual_sublayer(
            r, attend, wrong.get("ln_cross", block.ln_cross), **norm_and_dropout
        )

    steps = [self_attention]
    if block.cross_attention and not wrong.get("no_cross"):
        steps.append(cross_attention)
        if wrong.get("cross_first"):
            steps.reverse()
    x = inputs["x"]
    for step in steps:
        x = step(x)
    return residual_sublayer(x, block.mlp, block.ln2, **norm_and_dropout)


def _block_mistakes(block: TransformerBlock, *args: Tensor | None) -> dict[str, Tensor]:
    other = "post" if block.norm == "pre" else "pre"
    mistakes = [
        (f"this is {other}-LN: give residual_sublayer norm=self.norm.", dict(norm=other)),
        ("the padding is visible: pass mask to the self-attention (mask=mask).", dict(mask=None)),
    ]
    if block.causal:
        hint = (
            "the self-attention must be causal (causal=self.causal): no position sees a later one."
        )
        mistakes.append((hint, dict(causal=False)))
    else:
        hint = (
            "this block's self-attention is not causal: pass causal=self.causal (False in the "
            "encoder, where every source position sees every other)."
        )
        mistakes.append((hint, dict(causal=True)))
    if block.cross_attention:
        mistakes += [
            (
                "the cross-attention sublayer is missing: with self.cross_attention, attend to "
                "context between self-attention and the MLP.",
                dict(no_cross=True),
            ),
            (
                "the cross-attention ignores the source padding: pass context_mask to "
                "self.cross_attn.",
                dict(context_mask=None),
            ),
            (
                "cross-attention takes its keys and values from context (the encoder's output): "
                "self.cross_attn(x, context, mask=context_mask).",
                dict(context=None, context_mask=None),
            ),
            (
                "each sublayer has its own layer norm: self.ln_cross for the cross-attention.",
                dict(ln_cross=block.ln1),
            ),
            (
                "the cross-attention's layer norm is self.ln_cross, not self.ln2 (the MLP's).",
                dict(ln_cross=block.ln2),
            ),
            (
                "the order is self-attention, then cross-attention, then the MLP.",
                dict(cross_first=True),
            ),
        ]
    inputs = dict(zip(("x", "mask", "context", "context_mask"), args))
    return {hint: _block_run(block, inputs, **wrong) for hint, wrong in mistakes}


def _reference_block(norm: str, decoder: bool, dropout: float = 0.0) -> TransformerBlock:
    torch.manual_seed(1)
    block = TransformerBlock(
        16,
        4,
        4,
        32,
        norm=norm,
        act_fn="relu",
        dropout=dropout,
        causal=decoder,
        cross_attention=decoder,
    )
    return _noisy(block.double(), seed=2).eval()


def check_seq2seq_block(cls: type) -> None:
    """`cls(d_model, n_heads, d_head, d_mlp, *, norm, act_fn, dropout, causal, cross_attention)`:
    the encoder's block (self-attention over the whole source) and the decoder's (causal
    self-attention, cross-attention to `context`), each sublayer a `residual_sublayer`."""
    x, mask, context, context_mask = _block_inputs()
    for decoder in (False, True):
        for norm in ("post", "pre"):
            settings = dict(norm=norm, act_fn="relu", causal=decoder, cross_attention=decoder)
            where = f"TransformerBlock({', '.join(f'{k}={v!r}' for k, v in settings.items())})"
            reference = _reference_block(norm, decoder)
            block = call(f"{where}.__init__", cls, 16, 4, 4, 32, **settings).double()
            load_reference_weights(
                where, block, reference, "ln1, attn, ln_cross, cross_attn, ln2, mlp"
            )
            block.eval()
            args = (x, mask, context if decoder else None, context_mask if decoder else None)
            _expect_block_output(where, block, reference, args)
            hooks = {**BLOCK_HOOKS, **(CROSS_HOOKS if decoder else {})}
            expect_hooks(where, block, reference, hooks, *args)
            ours = _reference_block(norm, decoder, dropout=0.3)
            theirs = call(f"{where}.__init__", cls, 16, 4, 4, 32, **settings, dropout=0.3).double()
            theirs.load_state_dict(ours.state_dict())
            expect_same_in_train_mode(
                f"{where}, dropout=0.3",
                theirs,
                ours,
                *args,
                hint="give every residual_sublayer dropout=self.dropout; add no other dropout.",
            )
    passed("TransformerBlock")


def _call_block(where: str, block, args: tuple) -> Tensor:
    """The learner's forward pass; when the decoder's crashes, say which length is which."""
    x, _, context, _ = args
    try:
        return call(f"{where}.forward", block, *args)
    except CheckFailure as failure:
        if context is None or failure.__cause__ is None:
            raise
        raise CheckFailure(
            f"{failure}\nHint: the stream has {x.shape[1]} positions and the context "
            f"{context.shape[1]}. Queries come from the stream; keys, values and context_mask "
            "belong to the context: self.cross_attn(x, context, mask=context_mask)."
        ) from failure.__cause__


def _expect_block_output(where: str, block, reference: TransformerBlock, args: tuple) -> None:
    x, _, context, _ = args
    with torch.no_grad():
        actual = _call_block(where, block, args)
        expected = reference(*args)
        if (
            isinstance(actual, Tensor)
            and context is not None
            and actual.shape[1] == context.shape[1]
        ):
            expect(
                False,
                where,
                f"the output has the context's length {context.shape[1]}, not "
                f"the stream's {x.shape[1]}.",
                "cross-attention takes its queries from the "
                "residual stream: self.cross_attn(x, context, mask=context_mask).",
            )
        if _differs(actual, expected):
            _raise_for_known_mistake(actual, _block_mistakes(reference, *args), where)
        expect_close(
            actual,
            expected,
            where,
            "self-attention (causal=self.causal, mask=mask), "
            "then with self.cross_attention the cross-attention to context, then the "
            "MLP, each through residual_sublayer with its own layer norm and hook.",
            atol=1e-6,
        )
        if context is None:  # the default arguments: no mask at all
            default = call(f"{where}.forward", block, x)
            expect_close(
                default,
                reference(x),
                f"{where} with mask left at its default, None",
                "with mask=None the self-attention hides nothing but, if causal, the future.",
                atol=1e-6,
            )
        else:
            default = call(f"{where}.forward", block, x, context=context)
            expect_close(
                default,
                reference(x, context=context),
                f"{where} with mask and context_mask left at their default, None",
                "with no masks every context position may be attended to.",
                atol=1e-6,
            )


def _model_config(norm: str, tie: bool) -> Seq2SeqConfig:
    return Seq2SeqConfig(
        src_vocab=13,
        tgt_vocab=13,
        d_model=16,
        n_heads=4,
        n_layers=2,
        d_mlp=32,
        dropout=0.0,
        n_ctx=12,
        norm=norm,
        share_embeddings=tie,
        tie_embeddings=tie,
    )


def _decode_mistakes(
    model: EncoderDecoderTransformer, tgt: Tensor, memory: Tensor, src_mask: Tensor
) -> dict[str, Tensor]:
    """The reference's decode with one classic mistake each."""

    def decode(tgt_mask: Tensor | None, context_mask: Tensor | None, final_norm: bool = True):
        x = model.tgt_embed(tgt)
        for block in model.decoder:
            x = block(x, tgt_mask, context=memory, context_mask=context_mask)
        if model.cfg.norm == "pre" and final_norm:
            x = model.ln_dec(x)
        W_U = model.tgt_embed.W_E.T if model.cfg.tie_embeddings else model.W_U
        return x @ W_U + model.b_U

    tgt_mask = padding_mask(tgt, model.cfg.pad_id)
    mistakes = {
        "the target's padding is visible: give every decoder block padding_mask(tgt, pad_id) as "
        "its mask (the blocks are causal themselves).": decode(None, src_mask),
        "the source padding is visible: give every decoder block context_mask=src_mask.": decode(
            tgt_mask, None
        ),
    }
    if model.cfg.norm == "pre":
        mistakes[
            "with pre-LN the stream is never normalised inside the blocks: end the decoder "
            "with self.ln_dec."
        ] = decode(tgt_mask, src_mask, final_norm=False)
    return mistakes


def check_encoder_decoder(cls: type) -> None:
    """`cls(cfg).encode(src)` and `.decode(tgt, memory, src_mask)` against the reference, with
    post-LN and pre-LN, tied and untied embeddings, padded sources and targets."""
    name = "EncoderDecoderTransformer"
    src = torch.tensor([[3, 4, 5, 6, 2], [7, 8, 2, 0, 0]])
    tgt = torch.tensor([[1, 9, 10, 11], [1, 12, 0, 0]])
    for norm, tie in (("post", True), ("pre", False)):
        where = f"{name} (norm={norm!r}, tied embeddings={tie})"
        cfg = _model_config(norm, tie)
        torch.manual_seed(4)
        ours = _noisy(EncoderDecoderTransformer(cfg).double(), seed=5).eval()
        theirs = call(name, cls, cfg).double()
        parts = "src_embed, tgt_embed, encoder, decoder, ln_enc, ln_dec, b_U"
        load_reference_weights(where, theirs, ours, parts)
        theirs.eval()
        with torch.no_grad():
            memory = call(f"{name}.encode", theirs.encode, src)
            expected = ours.encode(src)
            if norm == "pre" and _differs(memory, expected):
                unnormed = ours.src_embed(src)
                for block in ours.encoder:
                    unnormed = block(unnormed, ours.src_mask(src))
                hint = (
                    "with pre-LN the stream is never normalised inside the blocks: end the "
                    "encoder with self.ln_enc."
                )
                _raise_for_known_mistake(memory, {hint: unnormed}, f"{where}, encode")
            expect_close(
                memory,
                expected,
                f"{where}, encode",
                "embed the source, run every "
                "encoder block with the source padding mask, then (pre-LN only) ln_enc.",
                atol=1e-6,
            )
            src_mask = ours.src_mask(src)
            logits = call(f"{name}.decode", theirs.decode, tgt, expected, src_mask)
            wanted = ours.decode(tgt, expected, src_mask)
            if _differs(logits, wanted):
                mistakes = _decode_mistakes(ours, tgt, expected, src_mask)
                _raise_for_known_mistake(logits, mistakes, f"{where}, decode")
            expect_close(
                logits,
                wanted,
                f"{where}, decode",
                "embed the target; every decoder "
                "block gets the target padding mask, context=memory and "
                "context_mask=src_mask; (pre-LN) ln_dec; then logits = x @ W_U + b_U, "
                "with W_U = tgt_embed.W_E.T when the embeddings are tied.",
                atol=1e-6,
            )
    passed(name)


def check_inverse_sqrt_lr(fn: Callable[..., float]) -> None:
    """`fn(step, *, lr, warmup_steps)`: linear warmup to `lr`, then `lr * sqrt(warmup / n)`."""
    name = "inverse_sqrt_lr"
    for lr, warmup in ((1e-3, 100), (7e-4, 4000)):
        for step in (0, 1, warmup // 2, warmup - 2, warmup - 1, warmup, 3 * warmup, 100 * warmup):
            actual = call(name, fn, step, lr=lr, warmup_steps=warmup)
            expected = inverse_sqrt_lr(step, lr=lr, warmup_steps=warmup)
            where = f"{name}(step={step}, lr={lr}, warmup_steps={warmup})"
            expect(
                isinstance(actual, (int, float)) and math.isfinite(actual),
                where,
                f"expected a finite number, got {actual!r}.",
            )
            if not math.isclose(actual, expected, rel_tol=1e-9):
                hint = "n = step + 1; return lr * min(n / warmup_steps, sqrt(warmup_steps / n))."
                if math.isclose(
                    actual, lr * min(step / warmup, math.sqrt(warmup / max(step, 1))), abs_tol=1e-15
                ):
                    hint = (
                        f"steps count from 0, so use n = step + 1: step 0 needs a positive rate "
                        f"and the peak, lr itself, comes at step {warmup - 1}."
                    )
                elif step >= warmup and math.isclose(
                    actual, lr * warmup / (step + 1), rel_tol=1e-9
                ):
                    hint = (
                        "after warmup the rate falls with the square root of the step, not the "
                        "step itself."
                    )
                expect(False, where, f"expected {expected:.6g}, got {actual:.6g}.", hint)
    passed(name)


class _Tree(EncoderDecoderTransformer):
    """Next-token probabilities by the previous token, one tree per first source token: greedy
    decoding takes the likelier first token, a beam of 2 finds the likelier whole translation."""

    TREES = {
        3: {1: {5: 0.6, 6: 0.4}, 5: {2: 0.4, 7: 0.3, 8: 0.3}, 6: {2: 0.9, 7: 0.1}},
        4: {1: {5: 0.4, 6: 0.6}, 5: {2: 0.95, 7: 0.05}, 6: {2: 0.4, 7: 0.3, 8: 0.3}},
    }

    def __init__(self):
        super().__init__(
            Seq2SeqConfig(
                src_vocab=12,
                tgt_vocab=12,
                d_model=8,
                n_heads=2,
                n_layers=1,
                d_mlp=8,
                dropout=0.0,
                n_ctx=8,
            )
        )

    def encode(self, src):
        return src[..., None].double().expand(*src.shape, self.cfg.d_model)

    def decode(self, tgt, memory, src_mask):
        logits = torch.full((*tgt.shape, self.cfg.tgt_vocab), -30.0)
        for row, first in enumerate(memory[:, 0, 0].long().tolist()):
            for pos, token in enumerate(tgt[row].tolist()):
                for nxt, p in self.TREES[first].get(token, {2: 1.0}).items():
                    logits[row, pos, nxt] = math.log(p)
        return logits


def _random_translator(seed: int) -> EncoderDecoderTransformer:
    """A tiny untrained translator (vocabulary 20, ids 0-2 special) to decode with."""
    torch.manual_seed(seed)
    sizes = dict(src_vocab=20, tgt_vocab=20, d_model=16, n_heads=2, n_layers=1, d_mlp=16)
    cfg = Seq2SeqConfig(**sizes, dropout=0.0, n_ctx=16)
    return EncoderDecoderTransformer(cfg)


def check_beam_search(fn: Callable[..., list[list[int]]]) -> None:
    """`fn(model, src, *, bos_id, eos_id, max_new_tokens, beam_size)`: the likeliest translation
    among the beams, per row, without bos and eos."""
    name = "beam_search"
    model = _random_translator(seed=6).eval()
    src = torch.randint(3, 20, (3, 5))
    one = call(name, fn, model, src, bos_id=1, eos_id=2, max_new_tokens=8, beam_size=1)
    expect(
        one == greedy_decode(model, src, bos_id=1, eos_id=2, max_new_tokens=8),
        f"{name} (beam_size=1)",
        f"a beam of one should be greedy decoding; got {one}.",
        "keep the beam_size best (sequence, total log-probability) pairs at each step.",
    )
    tree = _Tree().eval()
    src = torch.tensor([[3, 3], [4, 4]])
    greedy = greedy_decode(tree, src, bos_id=1, eos_id=2, max_new_tokens=4)
    found = call(name, fn, tree, src, bos_id=1, eos_id=2, max_new_tokens=4, beam_size=2)
    where = f"{name} (beam_size=2, two rows whose greedy choice is not the likeliest translation)"
    expect(
        isinstance(found, list) and len(found) == 2,
        where,
        f"expected one list per source row, got {found!r}.",
    )
    expect(
        found != greedy,
        where,
        f"got the greedy translations {greedy}.",
        "score each hypothesis by the sum of its tokens' log-probabilities and keep beam_size of "
        "them, so a less likely first token can win with a likelier ending.",
    )
    expect(
        found == [[6], [5]],
        where,
        f"expected [[6], [5]], got {found}.",
        "decode each row with its own beams, and return tokens without <s> and </s>.",
    )
    passed(name)


def check_label_smoothing(fn: Callable[..., Tensor]) -> None:
    """`fn(logits, targets, smoothing=, ignore_index=)` must equal
    `F.cross_entropy(..., label_smoothing=)`."""
    name = "label_smoothed_cross_entropy"
    torch.manual_seed(2)
    logits = torch.randn(3, 6, 9, dtype=torch.float64)
    targets = torch.randint(1, 9, (3, 6))
    targets[0, 3:] = 0
    actual = call(name, fn, logits, targets, smoothing=0.2, ignore_index=0)
    expected = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), label_smoothing=0.2, ignore_index=0
    )
    log_probs = logits.log_softmax(-1)
    nll = -log_probs.gather(-1, targets[..., None]).squeeze(-1)
    keep = targets != 0
    others = (-log_probs.sum(-1) - nll) / 8
    smoothed = 0.8 * nll + 0.2 * -log_probs.mean(-1)
    mistakes = {
        "the smoothing mass is spread over all vocab tokens, the right one included: the target is "
        "(1 - smoothing) * one_hot + smoothing / vocab (so the loss is (1 - s) * nll + "
        "s * mean(-log p)).": ((0.8 * nll + 0.2 * others) * keep).sum() / keep.sum(),
        "padding positions count: ignore positions whose target is ignore_index, and average over "
        "the others only.": smoothed.mean(),
        "the padding positions are zeroed but still counted in the average: divide by the number "
        "of real tokens.": (smoothed * keep).sum() / keep.numel(),
        "there is no smoothing: mix (1 - smoothing) * nll with smoothing * mean(-log p) over the "
        "vocabulary.": (nll * keep).sum() / keep.sum(),
    }
    if _differs(actual, expected):
        _raise_for_known_mistake(actual, mistakes, name)
    expect_close(
        actual,
        expected,
        name,
        "(1 - s) * nll + s * mean over the vocab of -log p, averaged over non-padding targets.",
        atol=1e-6,
    )

    where = f"{name} (ignore_index left at its default, None)"
    actual = call(where, fn, logits, targets, smoothing=0.2)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.2)
    expect_close(
        actual, expected, where, "with ignore_index=None every position counts.", atol=1e-6
    )

    where = f"{name} (confident logits, scaled by 1000)"
    actual = call(where, fn, logits * 1000, targets, smoothing=0.2, ignore_index=0)
    expected = F.cross_entropy(
        (logits * 1000).flatten(0, 1), targets.flatten(), label_smoothing=0.2, ignore_index=0
    )
    expect_close(
        actual,
        expected,
        where,
        "softmax(...).log() underflows to log(0) = -inf for unlikely "
        "tokens: use logits.log_softmax(-1), which stays finite.",
        atol=1e-3,
        rtol=1e-4,
    )
    passed(name)


class _Scripted(EncoderDecoderTransformer):
    """Emits 5, 6, 7, ... and then the end token at position `eos_at`, whatever the input; with a
    dict, `eos_at[first source token]`, so each row ends on its own (whether the rows are decoded
    as one batch or one by one). After its end token a row goes on emitting 5, 6, 7, ..."""

    def __init__(self, eos_at: int | dict[int, int]):
        super().__init__(
            Seq2SeqConfig(
                src_vocab=20,
                tgt_vocab=20,
                d_model=8,
                n_heads=2,
                n_layers=1,
                d_mlp=8,
                dropout=0.0,
                n_ctx=16,
            )
        )
        self.eos_at = eos_at

    def encode(self, src):
        return src[..., None].double().expand(*src.shape, self.cfg.d_model)

    def decode(self, tgt, memory, src_mask):
        logits = torch.full((*tgt.shape, self.cfg.tgt_vocab), -10.0)
        for row, first in enumerate(memory[:, 0, 0].long().tolist()):
            end = self.eos_at[first] if isinstance(self.eos_at, dict) else self.eos_at
            for pos in range(tgt.shape[1]):
                logits[row, pos, 2 if pos + 1 == end else 5 + pos % 10] = 10.0
        return logits


def check_greedy_decode(fn: Callable[..., list[list[int]]]) -> None:
    """`fn(model, src, bos_id=, eos_id=, max_new_tokens=)` must return the greedy tokens, without
    bos and eos."""
    name = "greedy_decode"
    src = torch.tensor([[3, 4], [5, 0]])
    stops = call(name, fn, _Scripted(eos_at=4), src, bos_id=1, eos_id=2, max_new_tokens=10)
    expect(
        isinstance(stops, list) and len(stops) == 2,
        name,
        f"expected one list of ids per source row (2), got {stops!r}.",
    )
    expect(
        stops != [[1, 5, 6, 7]] * 2 and stops != [[1, 5, 6, 7, 2]] * 2,
        name,
        "the start token is in the output.",
        "return only the generated tokens: drop the <s> you started with.",
    )
    expect(
        stops != [[5, 6, 7, 2]] * 2,
        name,
        "the end token is in the output.",
        "cut each row before its </s>.",
    )
    expect(
        stops == [[5, 6, 7]] * 2,
        name,
        f"a model that says 5, 6, 7, </s> should give [5, 6, 7], got {stops[0]!r}.",
        "append the argmax of the last position's logits each step; a row is done at </s>.",
    )
    ragged = call(
        name, fn, _Scripted(eos_at={3: 2, 5: 4}), src, bos_id=1, eos_id=2, max_new_tokens=10
    )
    expect(
        ragged == [[5], [5, 6, 7]],
        name,
        f"rows that end at different steps (row 0 after 5, row 1 after 5, 6, 7) gave {ragged!r}.",
        "keep decoding until every row has produced </s> (a finished row only gets padding), and "
        "cut each row before its own first </s>.",
    )
    capped = call(name, fn, _Scripted(eos_at=99), src, bos_id=1, eos_id=2, max_new_tokens=5)
    expect(
        capped == [[5, 6, 7, 8, 9]] * 2,
        name,
        f"with max_new_tokens=5 and no </s>, expected 5 generated tokens per row, "
        f"got {capped[0]!r}.",
        "generate at most max_new_tokens tokens, counting the </s>.",
    )
    model = _random_translator(seed=3)
    real_src = torch.randint(3, 20, (4, 6))
    real_src[1, 3:] = 0
    expected = greedy_decode(model, real_src, bos_id=1, eos_id=2, max_new_tokens=8)
    actual = call(name, fn, model, real_src, bos_id=1, eos_id=2, max_new_tokens=8)
    expect(
        actual == expected,
        name,
        f"on a random model expected {expected}, got {actual}.",
        "encode once, then repeatedly decode the tokens so far and append the argmax of the last "
        "position.",
    )
    passed(name)
