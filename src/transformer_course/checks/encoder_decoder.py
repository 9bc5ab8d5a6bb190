"""Checkers for chapter 5: positional encoding, the scaled embedding, a decoder block, label smoothing
and greedy decoding.

Each checker runs the learner's code next to the course's reference in float64. When the two
differ, it compares the learner's output with the classic mistakes (sin and cos swapped, the
missing sqrt(d_model) scale, an unmasked decoder, ...) and names the one that matches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer_course.checks import (
    CheckFailure,
    call,
    expect,
    expect_close,
    expect_same_in_train_mode,
    load_reference_weights,
    passed,
)
from transformer_course.encoder_decoder import (
    DecoderBlock,
    EncoderBlock,
    EncoderDecoderTransformer,
    Seq2SeqConfig,
    TokenEmbedding,
    greedy_decode,
    sinusoidal_positional_encoding,
)
from transformer_course.masking import causal_mask, padding_mask
from transformer_course.training import inverse_sqrt_lr

__all__ = [
    "check_beam_search",
    "check_encoder_block",
    "check_encoder_decoder",
    "check_inverse_sqrt_lr",
    "check_decoder_block",
    "check_greedy_decode",
    "check_label_smoothing",
    "check_positional_encoding",
    "check_token_embedding",
]


def _diagnose(actual: Tensor, mistakes: dict[str, Tensor], name: str, atol: float = 1e-6) -> None:
    """Raise a `CheckFailure` naming the first classic mistake `actual` matches (else return)."""
    for hint, wrong in mistakes.items():
        if wrong.shape == actual.shape and torch.allclose(actual.detach().double(), wrong.double(), atol=atol):
            raise CheckFailure(f"`{name}`: values differ from the reference.\nHint: {hint}")


def _pe_mistakes(max_len: int, d_model: int) -> dict[str, Tensor]:
    position = torch.arange(max_len, dtype=torch.float64)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)
    angles = position / 10000 ** (two_i / d_model)

    def interleave(even: Tensor, odd: Tensor) -> Tensor:
        return torch.stack([even, odd], dim=-1).flatten(-2)

    per_dim = position / 10000 ** (torch.arange(d_model, dtype=torch.float64) / d_model)
    return {
        "sin and cos are swapped: even dimensions 2i get sin, odd dimensions 2i+1 get cos.":
            interleave(torch.cos(angles), torch.sin(angles)),
        "sin and cos should be interleaved (sin in dims 0, 2, 4, ...; cos in dims 1, 3, 5, ...), "
        "not the sines in the first half and the cosines in the second.":
            torch.cat([torch.sin(angles), torch.cos(angles)], dim=-1),
        "the exponent is 2i/d_model, where 2i is the even dimension of the pair: dims 2i and 2i+1 "
        "share one frequency.":
            interleave(torch.sin(per_dim[:, 0::2]), torch.cos(per_dim[:, 1::2])),
        "positions start at 0: the first row is sin(0) = 0 and cos(0) = 1.":
            interleave(torch.sin(angles + 1 / 10000 ** (two_i / d_model)), torch.cos(angles + 1 / 10000 ** (two_i / d_model))),
        "divide the position by 10000^(2i/d_model); multiplying by it gives huge angles.":
            interleave(torch.sin(position * 10000 ** (two_i / d_model)), torch.cos(position * 10000 ** (two_i / d_model))),
    }


def check_positional_encoding(fn: Callable[[int, int], Tensor]) -> None:
    """`fn(max_len, d_model)` must return the sinusoidal table of Vaswani et al., shape (max_len, d_model)."""
    name = "sinusoidal_positional_encoding"
    for max_len, d_model in ((7, 4), (50, 16)):
        actual = call(name, fn, max_len, d_model)
        expected = sinusoidal_positional_encoding(max_len, d_model, dtype=torch.float64)
        if isinstance(actual, Tensor) and actual.shape == expected.shape and not torch.allclose(
            actual.double(), expected, atol=1e-5
        ):
            _diagnose(actual, _pe_mistakes(max_len, d_model), name, atol=1e-5)
        expect_close(
            actual.double() if isinstance(actual, Tensor) else actual, expected, name,
            "PE[pos, 2i] = sin(pos / 10000^(2i/d_model)) and PE[pos, 2i+1] = cos(pos / 10000^(2i/d_model)).",
            atol=1e-5,
        )
    passed(name)


def check_token_embedding(cls: type) -> None:
    """`cls(vocab, d_model, max_len, dropout)` must return W_E[tokens] * sqrt(d_model) + PE."""
    name = "TokenEmbedding"
    vocab, d_model, max_len = 11, 16, 20
    torch.manual_seed(0)
    theirs = call(name, cls, vocab, d_model, max_len, 0.0)
    expect(hasattr(theirs, "W_E"), name, "expected a parameter `W_E` of shape (vocab, d_model).")
    ours = TokenEmbedding(vocab, d_model, max_len, 0.0).double()
    with torch.no_grad():
        theirs.W_E.data = ours.W_E.detach().clone()
    tokens = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    actual = call(f"{name}.forward", theirs, tokens)
    expected = ours(tokens)
    looked_up = ours.W_E[tokens]
    pe = sinusoidal_positional_encoding(5, d_model, dtype=torch.float64)
    mistakes = {
        "did you forget the sqrt(d_model) embedding scale? Multiply W_E[tokens] by sqrt(d_model) "
        "before adding the positional encoding.": looked_up + pe,
        "the embedding is divided by sqrt(d_model); multiply by it instead.": looked_up / math.sqrt(d_model) + pe,
        "scale only the token embedding by sqrt(d_model), not the sum with the positional encoding.":
            (looked_up + pe) * math.sqrt(d_model),
        "the positional encoding is missing: add PE[:pos] to the scaled embedding.": looked_up * math.sqrt(d_model),
        "scale by sqrt(d_model), not by d_model.": looked_up * d_model + pe,
    }
    if isinstance(actual, Tensor) and actual.shape == expected.shape and not torch.allclose(actual.double(), expected, atol=1e-6):
        _diagnose(actual, mistakes, name)
    expect_close(actual, expected.detach(), name, "return W_E[tokens] * sqrt(d_model) + PE[:pos], then dropout.", atol=1e-6)

    theirs = call(name, cls, vocab, d_model, max_len, 0.5).double()
    ours = TokenEmbedding(vocab, d_model, max_len, 0.5).double()
    theirs.load_state_dict(ours.state_dict())
    expect_same_in_train_mode(
        f"{name}(dropout=0.5)", theirs, ours, tokens,
        hint="apply self.dropout once, to the sum of the scaled embedding and the positional encoding.",
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


def check_encoder_block(cls: type) -> None:
    """`cls(cfg)` with the reference's submodules (`attn mlp ln1 ln2`): self-attention over the
    whole source (padding hidden), then the MLP, post-LN or pre-LN."""
    name = "EncoderBlock"
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    src_mask = padding_mask(torch.tensor([[3, 4, 5, 6, 7], [3, 4, 0, 0, 0]]), 0)
    for norm in ("post", "pre"):
        cfg = _block_config(norm)
        torch.manual_seed(1)
        ours = _noisy(EncoderBlock(cfg).double(), seed=2).eval()
        theirs = call(name, cls, cfg).double()
        load_reference_weights(name, theirs, ours, "attn, mlp, ln1, ln2")
        theirs.eval()
        where = f"{name} (norm={norm!r})"
        with torch.no_grad():
            actual = call(f"{name}.forward", theirs, x, src_mask)
            expected = ours(x, src_mask)
            other = _as_norm(ours, "pre" if norm == "post" else "post", EncoderBlock)
            mistakes = {
                "the source padding is visible: pass src_mask to the self-attention.": ours(x, None),
                f"this is {other.pre_norm and 'pre' or 'post'}-LN; with norm={norm!r} "
                + ("normalise after each residual sum: x = ln(x + sublayer(x))." if norm == "post"
                   else "normalise each sublayer's input: x = x + sublayer(ln(x)).") : other(x, src_mask),
            }
            if isinstance(actual, Tensor) and actual.shape == expected.shape and not torch.allclose(actual.double(), expected, atol=1e-6):
                _diagnose(actual, mistakes, where)
        expect_close(actual, expected, where, "self-attention with src_mask, then the MLP, each with dropout, "
                     "a residual connection and its layer norm.", atol=1e-6)
        cfg = Seq2SeqConfig(**{**vars(cfg), "dropout": 0.3})
        ours, theirs = EncoderBlock(cfg).double(), call(name, cls, cfg).double()
        theirs.load_state_dict(ours.state_dict())
        expect_same_in_train_mode(f"{where}, dropout=0.3", theirs, ours, x, src_mask,
                                  hint="apply self.dropout to each sublayer's output before the residual sum.")
    passed(name)


def _as_norm(block: torch.nn.Module, norm: str, cls: type) -> torch.nn.Module:
    twin = cls(_block_config(norm)).double().eval()
    twin.load_state_dict(block.state_dict())
    return twin


def _model_config(norm: str, tie: bool) -> Seq2SeqConfig:
    return Seq2SeqConfig(src_vocab=13, tgt_vocab=13, d_model=16, n_heads=4, n_layers=2, d_ff=32, dropout=0.0,
                         max_len=12, norm=norm, share_embeddings=tie, tie_embeddings=tie)


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
        load_reference_weights(where, theirs, ours, "src_embed, tgt_embed, encoder, decoder, ln_enc, ln_dec, b_U")
        theirs.eval()
        with torch.no_grad():
            memory = call(f"{name}.encode", theirs.encode, src)
            expected = ours.encode(src)
            if norm == "pre" and isinstance(memory, Tensor) and memory.shape == expected.shape:
                unnormed = ours.src_embed(src)
                for block in ours.encoder:
                    unnormed = block(unnormed, ours.src_mask(src))
                _diagnose(memory, {"with pre-LN the stream is never normalised inside the blocks: end the "
                                   "encoder with self.ln_enc.": unnormed}, f"{where}, encode")
            expect_close(memory, expected, f"{where}, encode", "embed the source, run every encoder block "
                         "with the source padding mask, then (pre-LN only) ln_enc.", atol=1e-6)
            logits = call(f"{name}.decode", theirs.decode, tgt, expected, ours.src_mask(src))
            wanted = ours.decode(tgt, expected, ours.src_mask(src))
            expect_close(logits, wanted, f"{where}, decode", "embed the target; each decoder block gets a causal "
                         "mask combined with the target padding mask, the memory and src_mask; (pre-LN) ln_dec; "
                         "then logits = x @ W_U + b_U, with W_U = tgt_embed.W_E.T when embeddings are tied.",
                         atol=1e-6)
    passed(name)


def check_inverse_sqrt_lr(fn: Callable[..., float]) -> None:
    """`fn(step, *, lr, warmup_steps)`: linear warmup to `lr`, then `lr * sqrt(warmup / n)`."""
    name = "inverse_sqrt_lr"
    for lr, warmup in ((1e-3, 100), (7e-4, 4000)):
        for step in (0, 1, warmup // 2, warmup - 2, warmup - 1, warmup, 3 * warmup, 100 * warmup):
            actual = call(name, fn, step, lr=lr, warmup_steps=warmup)
            expected = inverse_sqrt_lr(step, lr=lr, warmup_steps=warmup)
            where = f"{name}(step={step}, lr={lr}, warmup_steps={warmup})"
            expect(isinstance(actual, (int, float)) and math.isfinite(actual), where,
                   f"expected a finite number, got {actual!r}.")
            if not math.isclose(actual, expected, rel_tol=1e-9):
                hint = "n = step + 1; return lr * min(n / warmup_steps, sqrt(warmup_steps / n))."
                if math.isclose(actual, lr * min(step / warmup, math.sqrt(warmup / max(step, 1))), abs_tol=1e-15):
                    hint = (f"steps count from 0, so use n = step + 1: step 0 needs a positive rate "
                            f"and the peak, lr itself, comes at step {warmup - 1}.")
                elif step >= warmup and math.isclose(actual, lr * warmup / (step + 1), rel_tol=1e-9):
                    hint = "after warmup the rate falls with the square root of the step, not the step itself."
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
        super().__init__(Seq2SeqConfig(src_vocab=12, tgt_vocab=12, d_model=8, n_heads=2, n_layers=1, d_ff=8, dropout=0.0, max_len=8))

    def encode(self, src):
        return src[..., None].double().expand(*src.shape, self.cfg.d_model)

    def decode(self, tgt, memory, src_mask):
        logits = torch.full((*tgt.shape, self.cfg.tgt_vocab), -30.0)
        for row, first in enumerate(memory[:, 0, 0].long().tolist()):
            for pos, token in enumerate(tgt[row].tolist()):
                for nxt, p in self.TREES[first].get(token, {2: 1.0}).items():
                    logits[row, pos, nxt] = math.log(p)
        return logits


def check_beam_search(fn: Callable[..., list[list[int]]]) -> None:
    """`fn(model, src, *, bos_id, eos_id, max_len, beam_size)`: the likeliest translation among
    the beams, per row, without bos and eos."""
    name = "beam_search"
    torch.manual_seed(6)
    model = EncoderDecoderTransformer(
        Seq2SeqConfig(src_vocab=20, tgt_vocab=20, d_model=16, n_heads=2, n_layers=1, d_ff=16, dropout=0.0, max_len=16)
    ).eval()
    src = torch.randint(3, 20, (3, 5))
    one = call(name, fn, model, src, bos_id=1, eos_id=2, max_len=8, beam_size=1)
    expect(one == greedy_decode(model, src, bos_id=1, eos_id=2, max_len=8), f"{name} (beam_size=1)",
           f"a beam of one should be greedy decoding; got {one}.",
           "keep the beam_size best (sequence, total log-probability) pairs at each step.")
    tree = _Tree().eval()
    src = torch.tensor([[3, 3], [4, 4]])
    greedy = greedy_decode(tree, src, bos_id=1, eos_id=2, max_len=4)
    found = call(name, fn, tree, src, bos_id=1, eos_id=2, max_len=4, beam_size=2)
    where = f"{name} (beam_size=2, two rows whose greedy choice is not the likeliest translation)"
    expect(isinstance(found, list) and len(found) == 2, where, f"expected one list per source row, got {found!r}.")
    expect(found != greedy, where, f"got the greedy translations {greedy}.",
           "score each hypothesis by the sum of its tokens' log-probabilities and keep beam_size of "
           "them, so a less likely first token can win with a likelier ending.")
    expect(found == [[6], [5]], where, f"expected [[6], [5]], got {found}.",
           "decode each row with its own beams, and return tokens without <s> and </s>.")
    passed(name)


def _block_config(norm: str) -> Seq2SeqConfig:
    return Seq2SeqConfig(src_vocab=10, tgt_vocab=10, d_model=16, n_heads=4, n_layers=1, d_ff=32, dropout=0.0, norm=norm)


def check_decoder_block(cls: type) -> None:
    """`cls(cfg)` with the reference's submodules (`self_attn cross_attn mlp ln1 ln2 ln3`) must match it."""
    name = "DecoderBlock"
    for norm in ("post", "pre"):
        cfg = _block_config(norm)
        torch.manual_seed(1)
        ours = DecoderBlock(cfg).double()
        with torch.no_grad():  # random layer-norm gains and biases, so a misplaced norm shows
            for ln in (ours.ln1, ours.ln2, ours.ln3):
                ln.w.normal_(1.0, 0.3)
                ln.b.normal_(0.0, 0.3)
        theirs = call(name, cls, cfg)
        load_reference_weights(name, theirs, ours, "self_attn, cross_attn, mlp, ln1, ln2, ln3")
        theirs.double().eval()
        x = torch.randn(2, 5, cfg.d_model, dtype=torch.float64)
        memory = torch.randn(2, 4, cfg.d_model, dtype=torch.float64)
        src = torch.tensor([[3, 4, 5, 6], [3, 4, 0, 0]])
        tgt_mask, src_mask = causal_mask(5), padding_mask(src, 0)
        actual = call(f"{name}.forward", theirs, x, memory, tgt_mask, src_mask)
        expected = ours(x, memory, tgt_mask, src_mask)
        everything = torch.ones(5, 5, dtype=torch.bool)
        mistakes = {
            "is the self-attention masked? Pass tgt_mask to self_attn so a position cannot see later ones.":
                ours(x, memory, everything, src_mask),
            "the cross-attention ignores the source padding: pass src_mask to cross_attn.":
                ours(x, memory, tgt_mask, None),
        }
        if norm == "post":
            mistakes["this is pre-LN; with norm='post' normalise after each residual sum: x = ln(x + sublayer(x))."] = (
                DecoderBlock.forward(_as_pre(ours), x, memory, tgt_mask, src_mask)
            )
        if isinstance(actual, Tensor) and actual.shape == expected.shape and not torch.allclose(actual.double(), expected, atol=1e-6):
            _diagnose(actual, mistakes, name)
        expect_close(
            actual, expected.detach(), f"{name} (norm={norm!r})",
            "three sublayers in order: masked self-attention, cross-attention to memory (keys and values "
            "from memory, queries from x), MLP; each with dropout, a residual connection and its layer norm.",
            atol=1e-6,
        )
        _expect_block_dropout(name, cls, norm, x, memory, tgt_mask, src_mask)
    passed(name)


def _expect_block_dropout(name: str, cls: type, norm: str, *args: Tensor) -> None:
    """With dropout on, in train mode, the learner's dropout falls where the reference's does."""
    cfg = Seq2SeqConfig(**{**vars(_block_config(norm)), "dropout": 0.3})
    ours = DecoderBlock(cfg).double()
    theirs = call(name, cls, cfg).double()
    theirs.load_state_dict(ours.state_dict())
    expect_same_in_train_mode(
        f"{name} (norm={norm!r}, dropout=0.3)", theirs, ours, *args,
        hint="apply self.dropout to each sublayer's output before the residual sum "
        "(three times: self-attention, cross-attention, MLP), and nowhere else.",
    )


def _as_pre(block: DecoderBlock) -> DecoderBlock:
    twin = DecoderBlock(_block_config("pre")).double()
    twin.load_state_dict(block.state_dict())
    return twin


def check_label_smoothing(fn: Callable[..., Tensor]) -> None:
    """`fn(logits, targets, smoothing=, ignore_index=)` must equal `F.cross_entropy(..., label_smoothing=)`."""
    name = "label_smoothed_cross_entropy"
    torch.manual_seed(2)
    logits = torch.randn(3, 6, 9, dtype=torch.float64)
    targets = torch.randint(1, 9, (3, 6))
    targets[0, 3:] = 0
    actual = call(name, fn, logits, targets, smoothing=0.2, ignore_index=0)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.2, ignore_index=0)
    log_probs = logits.log_softmax(-1)
    nll = -log_probs.gather(-1, targets[..., None]).squeeze(-1)
    keep = targets != 0
    others = (-log_probs.sum(-1) - nll) / 8
    mistakes = {
        "the smoothing mass is spread over all vocab tokens, the right one included: the target is "
        "(1 - smoothing) * one_hot + smoothing / vocab (so the loss is (1 - s) * nll + s * mean(-log p)).":
            (((1 - 0.2) * nll + 0.2 * others) * keep).sum() / keep.sum(),
        "padding positions count: ignore positions whose target is ignore_index, and average over the others only.":
            ((0.8 * nll + 0.2 * -log_probs.mean(-1))).mean(),
        "the padding positions are zeroed but still counted in the average: divide by the number of real tokens.":
            ((0.8 * nll + 0.2 * -log_probs.mean(-1)) * keep).sum() / keep.numel(),
        "there is no smoothing: mix (1 - smoothing) * nll with smoothing * mean(-log p) over the vocabulary.":
            (nll * keep).sum() / keep.sum(),
    }
    if isinstance(actual, Tensor) and actual.shape == expected.shape and not torch.allclose(actual.double(), expected, atol=1e-6):
        _diagnose(actual, mistakes, name)
    expect_close(actual, expected, name, "(1 - s) * nll + s * mean over the vocab of -log p, averaged over non-padding targets.", atol=1e-6)

    where = f"{name} (ignore_index left at its default, None)"
    actual = call(where, fn, logits, targets, smoothing=0.2)
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.2)
    expect_close(actual, expected, where, "with ignore_index=None every position counts.", atol=1e-6)

    where = f"{name} (confident logits, scaled by 1000)"
    actual = call(where, fn, logits * 1000, targets, smoothing=0.2, ignore_index=0)
    expected = F.cross_entropy(
        (logits * 1000).flatten(0, 1), targets.flatten(), label_smoothing=0.2, ignore_index=0
    )
    expect_close(actual, expected, where, "softmax(...).log() underflows to log(0) = -inf for unlikely "
                 "tokens: use logits.log_softmax(-1), which stays finite.", atol=1e-3, rtol=1e-4)
    passed(name)


class _Scripted(EncoderDecoderTransformer):
    """Emits 5, 6, 7, ... and then the end token at position `eos_at`, whatever the input; with a
    dict, `eos_at[first source token]`, so each row ends on its own (whether the rows are decoded
    as one batch or one by one). After its end token a row goes on emitting 5, 6, 7, ..."""

    def __init__(self, eos_at: int | dict[int, int]):
        super().__init__(Seq2SeqConfig(src_vocab=20, tgt_vocab=20, d_model=8, n_heads=2, n_layers=1, d_ff=8, dropout=0.0, max_len=16))
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
    """`fn(model, src, bos_id=, eos_id=, max_len=)` must return the greedy tokens, without bos and eos."""
    name = "greedy_decode"
    src = torch.tensor([[3, 4], [5, 0]])
    stops = call(name, fn, _Scripted(eos_at=4), src, bos_id=1, eos_id=2, max_len=10)
    expect(isinstance(stops, list) and len(stops) == 2, name, f"expected one list of ids per source row (2), got {stops!r}.")
    expect(
        stops != [[1, 5, 6, 7]] * 2 and stops != [[1, 5, 6, 7, 2]] * 2, name,
        "the start token is in the output.", "return only the generated tokens: drop the <s> you started with."
    )
    expect(stops != [[5, 6, 7, 2]] * 2, name, "the end token is in the output.", "cut each row before its </s>.")
    expect(
        stops == [[5, 6, 7]] * 2, name, f"a model that says 5, 6, 7, </s> should give [5, 6, 7], got {stops[0]!r}.",
        "append the argmax of the last position's logits each step; a row is done at </s>.",
    )
    ragged = call(name, fn, _Scripted(eos_at={3: 2, 5: 4}), src, bos_id=1, eos_id=2, max_len=10)
    expect(
        ragged == [[5], [5, 6, 7]], name,
        f"rows that end at different steps (row 0 after 5, row 1 after 5, 6, 7) gave {ragged!r}.",
        "keep decoding until every row has produced </s> (a finished row only gets padding), and "
        "cut each row before its own first </s>.",
    )
    capped = call(name, fn, _Scripted(eos_at=99), src, bos_id=1, eos_id=2, max_len=5)
    expect(
        capped == [[5, 6, 7, 8, 9]] * 2, name,
        f"with max_len=5 and no </s>, expected 5 generated tokens per row, got {capped[0]!r}.",
        "generate at most max_len tokens, counting the </s>.",
    )
    torch.manual_seed(3)
    model = EncoderDecoderTransformer(
        Seq2SeqConfig(src_vocab=20, tgt_vocab=20, d_model=16, n_heads=2, n_layers=1, d_ff=16, dropout=0.0, max_len=16)
    )
    real_src = torch.randint(3, 20, (4, 6))
    real_src[1, 3:] = 0
    expected = greedy_decode(model, real_src, bos_id=1, eos_id=2, max_len=8)
    actual = call(name, fn, model, real_src, bos_id=1, eos_id=2, max_len=8)
    expect(
        actual == expected, name, f"on a random model expected {expected}, got {actual}.",
        "encode once, then repeatedly decode the tokens so far and append the argmax of the last position.",
    )
    passed(name)
