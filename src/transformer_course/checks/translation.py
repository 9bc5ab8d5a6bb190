"""Checkers for chapter 5's workbook (05_translation): the embeddings, the residual sublayer and
the blocks, the assembled model, label smoothing, the schedule, greedy decoding, beam search."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from unittest.mock import patch

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_course.blocks import ACTIVATIONS, MLP, TransformerBlock, residual_sublayer
from transformer_course.checks.harness import (
    build_module,
    call,
    expect,
    expect_cached,
    expect_close,
    expect_evaluating,
    expect_hooks,
    expect_raises,
    expect_same_in_train_mode,
    expect_schedule,
    load_reference_weights,
    passed,
    perturb,
    randn,
    seeded,
    shape_of,
)
from transformer_course.decoding import beam_search, greedy_decode
from transformer_course.encoder_decoder import (
    EncoderDecoderTransformer,
    Seq2SeqConfig,
    TokenEmbedding,
    sinusoidal_positional_encoding,
)
from transformer_course.layernorm import LayerNorm
from transformer_course.masking import padding_mask
from transformer_course.training import inverse_sqrt_lr


def check_positional_encoding(fn: Callable[[int, int], Tensor]) -> None:
    """`fn(seq_len, d_model)`: the sinusoidal table of Vaswani et al., (seq_len, d_model)."""
    name = "sinusoidal_positional_encoding"
    hint = "PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(the same angle)."
    for seq_len, d_model in ((7, 4), (50, 16)):
        actual = call(name, fn, seq_len, d_model)
        expected = sinusoidal_positional_encoding(seq_len, d_model, dtype=torch.float64)
        sin, cos = expected[:, 0::2], expected[:, 1::2]
        swapped = torch.stack([cos, sin], dim=-1).flatten(-2)
        mistakes = {
            "sin and cos are swapped: dims 2i get sin, dims 2i+1 cos.": swapped,
            "sin and cos should be interleaved (sin in dims 0, 2, ...; cos in dims 1, 3, ...), "
            "not one half each.": torch.cat([sin, cos], dim=-1),
        }
        expect_close(actual, expected, f"{name}({seq_len}, {d_model})", hint, mistakes=mistakes)
    passed(name)


def check_token_embedding(cls: type) -> None:
    """`cls(d_vocab, d_model, dropout)`: W_E[tokens] * sqrt(d_model) + PE, then dropout."""
    name, tokens = "TokenEmbedding", torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    torch.manual_seed(0)
    ours, theirs = TokenEmbedding(11, 16).double(), call(name, cls, 11, 16, 0.0).double()
    load_reference_weights(name, theirs, ours, "W_E, dropout")
    looked_up, pe = ours.W_E[tokens].detach(), sinusoidal_positional_encoding(5, 16).double()
    mistakes = {
        "did you forget the sqrt(d_model) embedding scale? Multiply by it.": looked_up + pe,
        "scale only the token embedding, not the positional encoding.": (looked_up + pe) * 4,
    }
    actual, hint = call(f"{name}.forward", theirs, tokens), "W_E[tokens] * sqrt(d_model) + PE."
    expect_close(actual, ours(tokens).detach(), name, hint, atol=1e-6, mistakes=mistakes)
    theirs, ours = call(name, cls, 11, 16, 0.5).double(), TokenEmbedding(11, 16, 0.5).double()
    hint = "apply self.dropout once, to the sum of the scaled embedding and the encoding."
    expect_same_in_train_mode(f"{name}(dropout=0.5)", theirs, ours, tokens, hint=hint)
    passed(name)


@torch.no_grad()
def check_residual_sublayer(fn: Callable[..., Tensor]) -> None:
    """`fn(resid, sublayer, ln, *, norm, dropout, hook_out)`: both norms, dropout, hooks."""
    name, resid, weight = "residual_sublayer", 3 * randn(2, 5, 16, seed=7) + 1, randn(16, 16) / 4
    ln, f = perturb(LayerNorm(16).double(), seed=7), lambda x: 2 * torch.tanh(x @ weight)
    normed = ln(resid)
    pre_ln = "this is pre-LN: with norm='post' the sublayer reads the stream as it is, and the "
    pre_ln += "norm comes after the residual add."
    mistakes = {  # by norm: the outputs of the classic bugs, keyed by their hint
        "pre": {
            "this is post-LN: with norm='pre' only what the sublayer reads is normalised, and its "
            "output joins the stream as it is.": ln(resid + f(resid)),
            "only the sublayer's input is normalised: add its output to resid itself, not to "
            "ln(resid).": normed + f(normed),
        },
        "post": {
            pre_ln: resid + f(normed),
            "the norm comes before the residual add here: post-LN normalises the stream after "
            "the sublayer's output has joined it.": normed + f(resid),
        },
    }

    def run(fn: Callable, norm: str, dropout: Callable, replace=None):
        seen: list[Tensor] = []
        hook_out = lambda t: seen.append(t.detach()) or (t if replace is None else replace)
        torch.manual_seed(1234)
        return call(name, fn, resid, f, ln, norm=norm, dropout=dropout, hook_out=hook_out), seen

    for norm, dropout in (("pre", None), ("post", None), ("pre", 0.5), ("post", 0.5)):
        train = f", dropout={dropout} in train mode" if dropout else ""
        where = f"{name}(norm={norm!r}{train})"
        drop = torch.nn.Dropout(dropout).train() if dropout else (lambda t: t)
        (actual, seen), (expected, wanted) = run(fn, norm, drop), run(residual_sublayer, norm, drop)
        hint = "pre-LN: the sublayer reads the normalised stream; its output, after dropout, "
        hint += "joins the stream itself."
        if norm == "post":
            hint = "post-LN: the sublayer reads the stream; the norm follows the residual add."
        wrong = mistakes[norm]
        if dropout:
            hint, wrong = "apply dropout once, to the sublayer's output, before hook_out.", {}
        expect_close(actual, expected, where, hint, atol=1e-8, mistakes=wrong)
        hint = "hook_out gets what is added to the stream: the output after dropout, once."
        once = len(seen) == 1 and torch.allclose(seen[0], wanted[0])
        problem = f"called {len(seen)} times, or with another tensor (before dropout?)."
        expect(once, f"{where}, hook_out", problem, hint)
        patched = run(fn, norm, drop, replace=torch.zeros_like(resid))[0]
        hint = "add what hook_out returns (a hook may replace the tensor), not what you passed it."
        zero = resid if norm == "pre" else normed
        expect_close(patched, zero, f"{where}, a patching hook", hint, atol=1e-8)
    passed(name)


BLOCK_HOOKS = {  # hook point: what it receives
    "hook_resid_pre": "the incoming residual stream, first",
    "hook_attn_out": "what self-attention adds to the stream, after dropout",
    "hook_resid_mid": "the stream after the self-attention sublayer",
    "hook_cross_attn_out": "what the cross-attention adds, after dropout",
    "hook_resid_mid_cross": "the stream after the cross-attention",
    "hook_mlp_out": "what the MLP adds to the stream, after dropout",
    "hook_resid_post": "the block's output",
}
BLOCK_MISTAKES = [  # (what is wrong, as keywords of `_block_output`; the hint naming it)
    ({"mask": None}, "the padding is visible: the mask is ignored; pass mask=mask to self.attn."),
    ({"no_cross": True}, "the cross-attention sublayer is missing: it follows self-attention."),
    ({"context_mask": None}, "the cross-attention ignores the source padding: pass context_mask."),
    ({"ln_cross": "ln2"}, "the cross-attention's layer norm is self.ln_cross, not self.ln2."),
    ({"cross_first": True}, "the order is self-attention, then cross-attention, then the MLP."),
    ({"causal": True}, "this block's self-attention is not causal: pass causal=self.causal."),
    ({"causal": False}, "the decoder's self-attention must be causal: causal=self.causal."),
    ({"normed_stream": True}, "only the sublayer's input is normalised, not the stream itself."),
]


def _block_output(block, x, mask=None, context=None, context_mask=None, **wrong) -> Tensor:
    """The reference `block`'s forward pass from its parts, with what is `wrong`."""
    causal = wrong.get("causal", block.causal)
    steps = [(lambda h: block.attn(h, mask=mask, causal=causal), block.ln1)]
    if block.cross_attention and not wrong.get("no_cross"):
        ln_cross = getattr(block, wrong.get("ln_cross", "ln_cross"))
        cross = (lambda h: block.cross_attn(h, context, mask=context_mask), ln_cross)
        steps.insert(0 if wrong.get("cross_first") else 1, cross)
    for index, (f, ln) in enumerate([*steps, (block.mlp, block.ln2)]):
        stream = ln(x) if index == 0 and wrong.get("normed_stream") else x
        x = stream + f(ln(x)) if block.norm == "pre" else ln(stream + f(x))
    return x


def check_seq2seq_block(cls: type) -> None:
    """`TransformerBlock(...)`, encoder and decoder, both norms: outputs, hooks, dropout, cache."""
    x, context = randn(2, 5, 16, seed=3), randn(2, 4, 16, seed=4)
    mask = padding_mask(torch.tensor([[3, 4, 5, 6, 7], [3, 4, 5, 0, 0]]), 0)
    context_mask = padding_mask(torch.tensor([[3, 4, 5, 6], [3, 4, 0, 0]]), 0)
    order = "self-attention (causal=self.causal, mask=mask), with self.cross_attention then the "
    order += "cross-attention to context, then the MLP: each a residual_sublayer."
    crash = "the stream has 5 positions and the context 4. Queries come from the stream; keys, "
    crash += "values and context_mask from the context: self.cross_attn(x, context, mask=...)."
    encoder = [("a padding mask", (x, mask), {}), ("mask left at its default", (x,), {})]
    decoder = [("padding masks", (x, mask, context, context_mask), {})]
    decoder.append(("mask and context_mask left at their default", (x,), {"context": context}))
    blocks = [(seq2seq, norm) for seq2seq in (False, True) for norm in ("post", "pre")]
    blocks = [dict(norm=n, act_fn="relu", causal=d, cross_attention=d) for d, n in blocks]
    blocks.append(dict(norm="pre", act_fn="gelu_new", causal=True, cross_attention=False))  # GPT-2
    for settings in blocks:
        name = f"TransformerBlock({', '.join(f'{k}={v!r}' for k, v in settings.items())})"
        cases, shape_hint = (decoder, crash) if settings["cross_attention"] else (encoder, order)
        torch.manual_seed(1)
        ours = perturb(TransformerBlock(16, 4, 4, 32, **settings, dropout=0.3).double(), seed=2)
        ours.eval()  # its dropout is off until the train-mode check below
        block = call(f"{name}.__init__", cls, 16, 4, 4, 32, **settings).double().eval()
        load_reference_weights(name, block, ours, "ln1, attn, ln_cross, cross_attn, ln2, mlp")
        for label, args, kwargs in cases:
            where = f"{name}, {label}"
            with torch.no_grad():
                actual = call(where, block, *args, hint=shape_hint, **kwargs)
                problem = f"expected the stream's shape {tuple(x.shape)}, got {shape_of(actual)}."
                expect(shape_of(actual) == x.shape, where, problem, shape_hint)
                inputs = dict(zip(("x", "mask", "context", "context_mask"), args), **kwargs)
                mistakes = {h: _block_output(ours, **(inputs | w)) for w, h in BLOCK_MISTAKES}
                expected = ours(*args, **kwargs)
            expect_close(actual, expected, where, order, atol=1e-6, mistakes=mistakes)
        hooks = {h: f"{h} gets {what}." for h, what in BLOCK_HOOKS.items() if hasattr(ours, h)}
        expect_hooks(name, block, ours, hooks, *cases[0][1])
        theirs = call(f"{name}.__init__", cls, 16, 4, 4, 32, **settings, dropout=0.3).double()
        hint = "give every residual_sublayer dropout=self.dropout, and add no other dropout."
        expect_same_in_train_mode(f"{name}, dropout=0.3", theirs, ours, *cases[0][1], hint=hint)
        if settings["causal"] and not settings["cross_attention"]:  # chapter 6's KV cache
            hint = "pass `cache` on to the self-attention: `self.attn(..., cache=cache)`."
            expect_cached(f"{name}(x, cache=...)", block, ours, randn(2, 6, 16), [4], hint)
    passed("TransformerBlock")


def check_encoder_decoder(cls: type) -> None:
    """`cls(cfg).encode(src)` and `.decode(tgt, memory, src_mask)`, both norms."""
    name = "EncoderDecoderTransformer"
    parts = "src_embed, tgt_embed, encoder, decoder, ln_enc, ln_dec, W_U, b_U"
    src = torch.tensor([[3, 4, 5, 6, 2], [7, 8, 2, 0, 0]])
    tgt = torch.tensor([[1, 9, 10, 11], [1, 12, 0, 0]])
    sizes = dict(src_vocab=13, tgt_vocab=13, d_model=16, n_heads=4, n_layers=2, d_mlp=32, n_ctx=12)
    target = "the target's padding is visible: give every decoder block padding_mask(tgt, pad_id) "
    target += "as its mask (the blocks are causal themselves)."
    source = "the source padding is visible: pass context_mask=src_mask."
    for norm, tie in (("post", True), ("pre", False)):
        cfg = Seq2SeqConfig(**sizes, norm=norm, share_embeddings=tie, tie_embeddings=tie)
        where = f"{name} (norm={norm!r}, tied embeddings={tie})"
        torch.manual_seed(4)
        ours = perturb(EncoderDecoderTransformer(cfg).double(), seed=5).eval()
        theirs = call(name, cls, cfg).double().eval()
        load_reference_weights(where, theirs, ours, parts)
        with torch.no_grad():
            encoded, memory = call(f"{name}.encode", theirs.encode, src), ours.encode(src)
            unnormed, src_mask = ours.src_embed(src), ours.src_mask(src)
            for block in ours.encoder:
                unnormed = block(unnormed, src_mask)
            ln_enc = "pre-LN never normalises the stream inside the blocks: end with self.ln_enc."
            mistakes = {ln_enc: unnormed} if norm == "pre" else {}
            hint = "embed, every encoder block with the source padding mask, then (pre-LN) ln_enc."
            expect_close(encoded, memory, f"{where}, encode", hint, atol=1e-6, mistakes=mistakes)
            args = tgt, memory, src_mask
            logits = call(f"{name}.decode", theirs.decode, *args)
            with patch.object(ours.cfg, "pad_id", -1):  # no token is padding: no target mask
                mistakes = {target: ours.decode(*args)}
            mistakes[source] = ours.decode(tgt, memory, None)
            hint = "embed the target; each decoder block gets the target padding mask, "
            hint += "context=memory, context_mask=src_mask; (pre-LN) ln_dec; then x @ W_U + b_U."
            wanted, where = ours.decode(*args), f"{where}, decode"
            expect_close(logits, wanted, where, hint, atol=1e-6, mistakes=mistakes)
    bad_src, bad_tgt = src.masked_fill(src == 2, -1), tgt.masked_fill(tgt == 1, 13)
    for label, method, given in (
        ("a source id -1", "encode", (bad_src,)),
        ("a target id 13 = tgt_vocab", "decode", (bad_tgt, *args[1:])),
    ):
        where = f"{name}.{method}({label})"
        refused = getattr(theirs, method)
        expect_raises(where, IDS_HINT, refused, *given, errors=(ValueError, TypeError))
    passed(name)


IDS_HINT = "ids outside [0, vocab) must be refused with a clear error: W_E[-1] silently reads "
IDS_HINT += (
    "the last row. Start each method with validate.token_tensor(name, tokens, vocab), given."
)


LABEL_SMOOTHING_CASES = [  # label, logits scale, options, hint
    ("", 1, dict(smoothing=0.2, ignore_index=0), "mix the target's nll and the vocab's mean."),
    (" (ignore_index left at its default, None)", 1, dict(smoothing=0.2), "every position counts."),
    (" (smoothing=0)", 1, dict(smoothing=0.0, ignore_index=0), "this is the plain cross-entropy."),
    (" (confident logits, scaled by 1000)", 1000, dict(smoothing=0.2, ignore_index=0), ""),
]
SPREAD_HINT = "the smoothing mass is spread over all vocab tokens, the right one included: the "
SPREAD_HINT += "target is (1 - s) * one_hot + s / vocab."
IGNORED_HINT = "ignore_index: the positions whose target is ignore_index (padding) must not "
IGNORED_HINT += "count, neither in the sum nor in the number you divide it by."
ALL_IGNORED_HINT = "a batch whose every target is ignore_index has no position to average: "
ALL_IGNORED_HINT += "its loss is 0 (divide by at least 1), not 0 / 0 = NaN."


def _smoothing_mistakes(logits, targets, smoothing, ignore_index) -> dict[str, Tensor]:
    """The losses of the classic mistakes of label smoothing, by their hints."""
    log_probs = logits.log_softmax(-1)
    kept = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != 0
    nll = -log_probs.gather(-1, targets[..., None]).squeeze(-1)
    others = (-log_probs.sum(-1) - nll) / (logits.shape[-1] - 1)
    smoothed = (1 - smoothing) * nll + smoothing * -log_probs.mean(-1)
    mistakes = {SPREAD_HINT: ((1 - smoothing) * nll + smoothing * others)[kept].mean()}
    if ignore_index is not None:
        mistakes[IGNORED_HINT] = smoothed.mean()  # padding's losses in the sum and the count
        mistakes[IGNORED_HINT + " "] = (smoothed * kept).sum() / kept.numel()  # in the count
    return mistakes


def check_label_smoothing(fn: Callable[..., Tensor]) -> None:
    """`fn(logits, targets, smoothing=, ignore_index=)`: `F.cross_entropy`'s result, and 0 for
    a batch without a position that counts."""
    name, logits = "label_smoothed_cross_entropy", randn(3, 6, 9, seed=2)
    targets = torch.randint(1, 9, (3, 6), generator=seeded(2))
    targets[0, 3:] = 0
    for label, scale, options, hint in LABEL_SMOOTHING_CASES:
        actual = call(name + label, fn, logits * scale, targets, **options)
        ignore, smoothing = options.get("ignore_index", -100), options["smoothing"]
        flat = (logits * scale).flatten(0, 1), targets.flatten()
        expected = F.cross_entropy(*flat, label_smoothing=smoothing, ignore_index=ignore)
        hint = hint or "softmax(...).log() underflows to log(0) = -inf: use log_softmax."
        wrong = _smoothing_mistakes(logits * scale, targets, smoothing, options.get("ignore_index"))
        expect_close(actual, expected, name + label, hint, atol=1e-6 * scale, mistakes=wrong)
    where = f"{name} (every target is ignore_index)"
    actual = call(where, fn, logits, torch.zeros_like(targets), smoothing=0.1, ignore_index=0)
    zero = torch.zeros((), dtype=logits.dtype)
    expect_close(actual, zero, where, ALL_IGNORED_HINT, atol=1e-12)
    passed(name)


def _inverse_sqrt(step: int, *, lr, warmup_steps, shift: int = 1, power: float = 0.5) -> float:
    """`inverse_sqrt_lr` with n = step + `shift` and the decay's `power` (two mistakes)."""
    n = step + shift
    return lr * min(n / warmup_steps, (warmup_steps / max(n, 1)) ** power)


def check_inverse_sqrt_lr(fn: Callable[..., float]) -> None:
    """`fn(step, *, lr, warmup_steps)`: linear warmup, then `lr * sqrt(warmup / n)`."""
    from_zero = "steps count from 0, so use n = step + 1: step 0 needs a positive rate and the "
    from_zero += "peak comes at step warmup_steps - 1."
    linear = "after warmup the rate falls with the square root of the step, not the step itself."
    mistakes = {from_zero: partial(_inverse_sqrt, shift=0), linear: partial(_inverse_sqrt, power=1)}
    hint = "a linear rise to lr at the end of warmup, then a fall with the inverse square root "
    hint += "of the step; warmup_steps=0 means no warmup, as 1."
    cases = [dict(lr=1e-3, warmup_steps=100), dict(lr=7e-4, warmup_steps=40)]
    expect_schedule("inverse_sqrt_lr", fn, inverse_sqrt_lr, cases, mistakes, hint)
    hint = "warmup_steps=0 means no warmup: the rate starts at lr (as warmup_steps=1 does), no "
    hint += "division by zero."
    no_warmup = [dict(lr=5e-4, warmup_steps=0)]
    expect_schedule("inverse_sqrt_lr", fn, inverse_sqrt_lr, no_warmup, {}, hint)
    passed("inverse_sqrt_lr")


TOY = dict(src_vocab=20, tgt_vocab=20, d_model=16, n_heads=2, n_layers=1, d_mlp=16, n_ctx=16)


class _Toy(EncoderDecoderTransformer):
    """A translator whose next-token probabilities are `rule(first source, position, token)`."""

    def __init__(self, rule: Callable[[int, int, int], dict[int, float]]):
        super().__init__(Seq2SeqConfig(**TOY, dropout=0.0))
        self.rule = rule

    def encode(self, src: Tensor) -> Tensor:
        return src[..., None].double().expand(*src.shape, self.cfg.d_model)

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor | None) -> Tensor:
        # Tokens the rule leaves out are very unlikely, each a little differently (no ties).
        unlisted = -30.0 + 1e-3 * torch.arange(self.cfg.tgt_vocab, dtype=torch.float32)
        logits = unlisted.expand(*tgt.shape, -1).clone()
        for row, first in enumerate(memory[:, 0, 0].long().tolist()):
            for pos, token in enumerate(tgt[row].tolist()):
                for nxt, p in self.rule(first, pos, token).items():
                    logits[row, pos, nxt] = math.log(p)
        return logits


def _scripted(end: Callable[[int], int]) -> _Toy:
    """Says 5, 6, 7, ... with the end token 2 as token number `end(first source token)`."""
    return _Toy(lambda first, pos, token: {2 if pos + 1 == end(first) else 5 + pos % 10: 1.0})


def _random_translator(seed: int, dropout: float = 0.0) -> EncoderDecoderTransformer:
    """A tiny untrained translator to decode with (ids 0-2 are special)."""
    torch.manual_seed(seed)
    return EncoderDecoderTransformer(Seq2SeqConfig(**TOY, dropout=dropout)).eval()


def check_greedy_decode(fn: Callable[..., list[list[int]]]) -> None:
    """`fn(model, src, bos_id=, eos_id=, max_new_tokens=)`: each row's greedy tokens."""
    name, src, ids = "greedy_decode", torch.tensor([[3, 4], [5, 0]]), dict(bos_id=1, eos_id=2)
    stops = call(name, fn, _scripted(lambda first: 4), src, **ids, max_new_tokens=10)
    hint = "append the argmax of the last position's logits each step; a row is done at </s>."
    where = f"{name} (a model that says 5, 6, 7, </s>)"
    bos = {"the start token is in the output: drop the <s> you started with.": [[1, 5, 6, 7]] * 2}
    expect_close(stops, [[5, 6, 7]] * 2, where, hint, mistakes=bos)
    ragged = call(name, fn, _scripted({3: 2, 5: 4}.get), src, **ids, max_new_tokens=10)
    hint = "keep decoding until every row has produced </s> (a finished row only gets padding), "
    hint += "and cut each row before its own first </s>."
    expect_close(ragged, [[5], [5, 6, 7]], f"{name} (rows that end at different steps)", hint)
    capped = call(name, fn, _scripted(lambda first: 99), src, **ids, max_new_tokens=5)
    hint, where = "stop after max_new_tokens tokens, </s> included.", f"{name}(max_new_tokens=5)"
    expect_close(capped, [[5, 6, 7, 8, 9]] * 2, where, hint)
    real_src = torch.randint(3, 20, (4, 6), generator=seeded(3))
    real_src[1, 3:] = 0
    for dropout in (0.0, 0.3):
        model = _random_translator(3, dropout)
        expected = greedy_decode(model, real_src, **ids, max_new_tokens=8)
        actual = expect_evaluating(name, fn, model, real_src, **ids, max_new_tokens=8)
        hint = "encode once, then repeatedly decode the tokens so far and append the argmax."
        expect_close(actual, expected, f"{name} (a random model, dropout={dropout})", hint)
    _expect_no_length_refused(name, fn, src)
    passed(name)


NO_LENGTH_HINT = "with max_new_tokens and max_len both None there is no length to stop at: "
NO_LENGTH_HINT += "refuse it with a ValueError (_decode_args, given, checks every argument)."


def _expect_no_length_refused(name: str, fn: Callable, src: Tensor) -> None:
    """Neither `max_new_tokens` nor its former name `max_len`: a ValueError, not a loop."""
    where, ids = f"{name}(max_new_tokens=None, max_len=None)", dict(bos_id=1, eos_id=2)
    decode = partial(fn, **ids, max_new_tokens=None, max_len=None)
    expect_raises(where, NO_LENGTH_HINT, decode, _scripted(lambda first: 4), src)


def check_beam_search(fn: Callable[..., list[list[int]]]) -> None:
    """`fn(model, src, *, bos_id, eos_id, max_new_tokens, beam_size)`: the likeliest."""
    name, ids = "beam_search", dict(bos_id=1, eos_id=2, max_new_tokens=8)
    trees = {  # by first source token: next-token probabilities by previous token
        3: {1: {5: 0.6, 6: 0.4}, 5: {2: 0.4, 7: 0.3, 8: 0.3}, 6: {2: 0.9, 7: 0.1}},
        4: {1: {5: 0.4, 6: 0.6}, 5: {2: 0.95, 7: 0.05}, 6: {2: 0.4, 7: 0.3, 8: 0.3}},
    }
    tree = _Toy(lambda first, pos, token: trees[first].get(token, {2: 1.0}))
    src, ids["max_new_tokens"] = torch.tensor([[3, 3], [4, 4]]), 4
    found = call(name, fn, tree, src, **ids, beam_size=2)
    where = f"{name} (beam_size=2, two rows whose greedy choice is not the likeliest translation)"
    greedy = "these are the greedy translations: score each hypothesis by the sum of its tokens' "
    greedy += "log-probabilities, so a less likely first token can win with a likelier ending."
    hint = "decode each row with its own beams, and return tokens without <s> and </s>."
    expect_close(found, [[6], [5]], where, hint, mistakes={greedy: greedy_decode(tree, src, **ids)})
    for label, rules, options, hint in BEAM_CASES:
        model, src = _Toy(lambda f, p, token, rules=rules: rules.get(token, {2: 1.0})), SRC
        where = f"{name}({', '.join(f'{k}={v}' for k, v in options.items())}), {label}"
        found = call(where, fn, model, src, bos_id=1, eos_id=2, beam_size=2, **options)
        wanted = beam_search(model, src, bos_id=1, eos_id=2, beam_size=2, **options)
        expect_close(found, wanted, where, hint)
    for dropout in (0.0, 0.3):
        model, src = _random_translator(6, dropout), torch.randint(3, 20, (3, 5))
        one = expect_evaluating(name, fn, model, src, **ids, beam_size=1)
        hint = "keep the beam_size best (sequence, total log-probability) pairs at each step."
        where = f"{name} (beam_size=1, dropout={dropout})"
        expect_close(one, greedy_decode(model, src, **ids), where, hint)
    _expect_no_length_refused(name, fn, src)
    passed(name)


SRC = torch.tensor([[3, 3]])  # one source row; the toy models ignore it
PENALTY = "divide each ended translation's total log-probability by length ** length_penalty"
# The toy model of both length_penalty cases: the default 0.6, and 1.0.
PENALTY_MATTERS = {
    1: {7: 1.0},
    5: {8: 0.58, 7: 0.42},
    6: {5: 0.77, 8: 0.23},
    7: {5: 0.48, 7: 0.24, 2: 0.28},
    8: {8: 0.54, 2: 0.46},
}
BEAM_CASES = [  # label, next-token probabilities by the token before, options, hint; each case
    # tells one mistake from the contract, and comes before the cases its mistake also changes
    (
        "no translation ends within max_new_tokens",
        {1: {8: 0.6, 7: 0.39}, 8: {8: 0.7, 7: 0.29}, 7: {8: 0.55, 7: 0.44}},
        dict(max_new_tokens=3),
        "when none has ended after max_new_tokens steps, the live beams compete (each over "
        "length ** length_penalty): return the best, never an empty list.",
    ),
    (
        "an unlikely </s> among the 2 * beam_size candidates",
        {
            1: {2: 0.12, 7: 0.45, 8: 0.42},
            6: {7: 0.39, 5: 0.17, 6: 0.44},
            7: {6: 1.0},
            8: {8: 0.28, 6: 0.72},
            5: {5: 1.0},
        },
        dict(max_new_tokens=3),
        "walk the candidates best first and stop once beam_size go on: an </s> after that is not "
        "among the best and is not set aside.",
    ),
    (
        "translations of different lengths",
        {
            1: {6: 0.17, 7: 0.65, 8: 0.18},
            5: {6: 0.64, 7: 0.36},
            6: {8: 0.17, 2: 0.83},
            7: {6: 0.39, 2: 0.55, 7: 0.06},
            8: {2: 0.47, 5: 0.53},
        },
        dict(max_new_tokens=3),
        "a translation's length counts its tokens and its </s>, not <s>: [5, 6, </s>] has 3.",
    ),
    (
        "length_penalty left at its default, 0.6",
        PENALTY_MATTERS,
        dict(max_new_tokens=4),
        f"{PENALTY}, with the length_penalty given (0.6 by default), not by the length itself.",
    ),
    (
        "an early </s> against a likelier longer translation",
        {
            1: {6: 0.26, 8: 0.44, 2: 0.3},
            6: {7: 0.34, 2: 0.61, 8: 0.04},
            7: {2: 1.0},
            8: {6: 0.48, 5: 0.52},
            5: {7: 1.0},
        },
        dict(max_new_tokens=3),
        f"rank by score, not by the raw sum: {PENALTY}, so short ones are not favoured.",
    ),
    (
        "length_penalty=1.0",
        PENALTY_MATTERS,
        dict(max_new_tokens=4, length_penalty=1.0),
        f"{PENALTY}, with the length_penalty argument, not a fixed exponent.",
    ),
]


def check_mlp(cls: type) -> None:
    """`MLP(d_model, d_mlp, act_fn="gelu_new")`: `act(x @ W_in + b_in) @ W_out + b_out`, hooked."""
    name, x = "MLP", randn(2, 5, 16, seed=3, dtype=torch.float32)
    params = {"W_in": (16, 64), "b_in": (64,), "W_out": (64, 16), "b_out": (16,)}
    mlp = perturb(build_module(name, cls, 16, 64, params=params), 0, 1.0)
    act = lambda f: f(x @ mlp.W_in + mlp.b_in) @ mlp.W_out + mlp.b_out
    mistakes = {
        "GPT-2 uses gelu_new, F.gelu(x, approximate='tanh'), not the exact GELU.": act(F.gelu),
        "the activation is GELU (gelu_new), not ReLU.": act(F.relu),
    }
    hint, expected = "x @ W_in + b_in, gelu_new, @ W_out + b_out.", act(ACTIVATIONS["gelu_new"])
    expect_close(call(name, mlp, x), expected, name, hint, mistakes=mistakes)
    for act_fn in ("relu", "gelu", "gelu_new"):
        where = f"{name}(act_fn={act_fn!r})"
        theirs, reference = call(where, cls, 16, 64, act_fn=act_fn), MLP(16, 64, act_fn)
        reference.load_state_dict(mlp.state_dict()), theirs.load_state_dict(mlp.state_dict())
        hint = "use the activation the module was built with, ACTIVATIONS[self.act_fn]."
        expect_close(call(where, theirs, x), reference(x).detach(), where, hint)
    hooks = {"hook_pre": "x @ W_in + b_in, before the activation", "hook_post": "act's output"}
    hooks = {hook: f"pass {what} through self.{hook}." for hook, what in hooks.items()}
    expect_hooks(name, mlp, reference, hooks, x, atol=1e-6)
    passed(name)
