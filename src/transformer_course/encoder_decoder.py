"""The encoder–decoder Transformer of Vaswani et al. (2017), built from the earlier chapters' parts.

The encoder reads the whole source sentence with unmasked self-attention. The decoder writes the
target one token at a time: masked (causal) self-attention over what it has written so far, then
cross-attention to the encoder's output, then an MLP. Layer norms sit after each residual sum
("post-LN", as in the paper) or before each sublayer ("pre-LN", `norm="pre"`).

Parameter names follow TransformerLens (`W_E`, `W_U`, `b_U`; attention `W_Q ... b_O`; MLP
`W_in ... b_out`; layer norm `w`, `b`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.attention import MultiHeadAttention
from transformer_course.blocks import ACTIVATIONS, MLP
from transformer_course.layernorm import LayerNorm
from transformer_course.masking import causal_mask, padding_mask

# The special tokens a translation tokenizer carries.
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# Token tensors must be signed integers: indexing with uint8 or bool selects by mask instead.
TOKEN_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


@dataclass
class Seq2SeqConfig:
    """Sizes of the model; the defaults are the paper's base model.

    `norm` is `"post"` (the paper) or `"pre"`. `share_embeddings` uses one embedding matrix for
    source and target (needs one shared vocabulary); `tie_embeddings` reuses the target embedding
    as the output projection (Press & Wolf, 2017).
    """

    src_vocab: int
    tgt_vocab: int
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    max_len: int = 256
    pad_id: int = 0
    norm: str = "post"
    act_fn: str = "relu"
    layer_norm_eps: float = 1e-5
    share_embeddings: bool = False
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("src_vocab", "tgt_vocab", "d_model", "n_heads", "n_layers", "d_ff", "max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.d_model % 2:
            raise ValueError(f"d_model: expected an even size (sin and cos come in pairs), got {self.d_model}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: expected a multiple of n_heads={self.n_heads}, got {self.d_model}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout}")
        if self.norm not in ("post", "pre"):
            raise ValueError(f"norm: expected 'post' or 'pre', got {self.norm!r}")
        if self.act_fn not in ACTIVATIONS:
            raise ValueError(f"act_fn: expected one of {sorted(ACTIVATIONS)}, got {self.act_fn!r}")
        validate.norm_args(self.d_model, self.layer_norm_eps)
        validate.token_id("pad_id", self.pad_id, min(self.src_vocab, self.tgt_vocab))
        if self.share_embeddings and self.src_vocab != self.tgt_vocab:
            raise ValueError(
                f"share_embeddings: needs src_vocab == tgt_vocab, got {self.src_vocab} and {self.tgt_vocab}"
            )


def sinusoidal_positional_encoding(
    max_len: int, d_model: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> Float[Tensor, "pos d_model"]:
    """The paper's fixed position vectors: PE[pos, 2i] = sin(pos / 10000^(2i/d_model)), PE[pos, 2i+1] = cos(...).

    Each pair of dimensions is a clock turning at its own frequency, from one turn every 2π
    positions down to one every 10000·2π, so nearby positions get similar vectors and
    PE[pos + k] is a fixed rotation of PE[pos].
    """
    position = torch.arange(max_len, dtype=torch.float64, device=device)[:, None]
    frequency = 10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64, device=device) / d_model)
    angles = position * frequency  # (pos, d_model / 2)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe.to(dtype)


class TokenEmbedding(nn.Module):
    """Token embedding times sqrt(d_model), plus the sinusoidal position, then dropout.

    The scale matters: embeddings are initialised with standard deviation 1/sqrt(d_model), so
    without it the position signal (entries of size ~1) would drown the token's identity.
    """

    def __init__(self, vocab: int, d_model: int, max_len: int, dropout: float = 0.0):
        super().__init__()
        self.d_model, self.max_len = d_model, max_len
        self.W_E = nn.Parameter(torch.randn(vocab, d_model) * d_model**-0.5)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        if tokens.shape[-1] > self.max_len:
            raise ValueError(
                f"tokens: expected at most max_len={self.max_len} positions, got {tokens.shape[-1]} "
                f"(shape {tuple(tokens.shape)}); shorten the sentence or build the model with a larger max_len"
            )
        x = self.W_E[tokens] * math.sqrt(self.d_model)
        pe = sinusoidal_positional_encoding(tokens.shape[-1], self.d_model, dtype=x.dtype, device=x.device)
        return self.dropout(x + pe)


class EncoderBlock(nn.Module):
    """Self-attention over the whole source, then an MLP, each with a residual connection."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, act_fn=cfg.act_fn)
        self.ln1 = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.ln2 = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: Float[Tensor, "batch src_pos d_model"], src_mask: Bool[Tensor, "batch 1 1 src_pos"] | None
    ) -> Float[Tensor, "batch src_pos d_model"]:
        if self.pre_norm:
            x = x + self.dropout(self.attn(self.ln1(x), mask=src_mask))
            return x + self.dropout(self.mlp(self.ln2(x)))
        x = self.ln1(x + self.dropout(self.attn(x, mask=src_mask)))
        return self.ln2(x + self.dropout(self.mlp(x)))


class DecoderBlock(nn.Module):
    """Masked self-attention, cross-attention to the encoder output, then an MLP."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads)
        self.mlp = MLP(cfg.d_model, cfg.d_ff, act_fn=cfg.act_fn)
        self.ln1 = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.ln2 = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.ln3 = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: Float[Tensor, "batch tgt_pos d_model"],
        memory: Float[Tensor, "batch src_pos d_model"],
        tgt_mask: Bool[Tensor, "batch 1 tgt_pos tgt_pos"],
        src_mask: Bool[Tensor, "batch 1 1 src_pos"] | None,
    ) -> Float[Tensor, "batch tgt_pos d_model"]:
        if self.pre_norm:
            x = x + self.dropout(self.self_attn(self.ln1(x), mask=tgt_mask))
            x = x + self.dropout(self.cross_attn(self.ln2(x), context=memory, mask=src_mask))
            return x + self.dropout(self.mlp(self.ln3(x)))
        x = self.ln1(x + self.dropout(self.self_attn(x, mask=tgt_mask)))
        x = self.ln2(x + self.dropout(self.cross_attn(x, context=memory, mask=src_mask)))
        return self.ln3(x + self.dropout(self.mlp(x)))


class EncoderDecoderTransformer(nn.Module):
    """Source tokens in, next-target-token logits out: `forward(src, tgt) -> (batch, tgt_len, tgt_vocab)`."""

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.cfg = cfg
        self.src_embed = TokenEmbedding(cfg.src_vocab, cfg.d_model, cfg.max_len, cfg.dropout)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else TokenEmbedding(
            cfg.tgt_vocab, cfg.d_model, cfg.max_len, cfg.dropout
        )
        self.encoder = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        # Pre-LN leaves the residual stream unnormalised, so each stack ends with a layer norm.
        if cfg.norm == "pre":
            self.ln_enc = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
            self.ln_dec = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        if not cfg.tie_embeddings:
            self.W_U = nn.Parameter(torch.randn(cfg.d_model, cfg.tgt_vocab) * cfg.d_model**-0.5)
        self.b_U = nn.Parameter(torch.zeros(cfg.tgt_vocab))

    def _validate_tokens(self, name: str, tokens: Any, vocab: int) -> None:
        if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.dtype not in TOKEN_DTYPES:
            got = f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(
                f"{name}: expected an integer tensor (int64, int32, ...) of shape (batch, pos), "
                f"got {got}"
            )
        if tokens.shape[1] == 0:
            raise ValueError(
                f"{name}: expected at least one position, got shape {tuple(tokens.shape)}"
            )
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(f"{name}: expected ids in [0, {vocab}), got values from {tokens.min()} to {tokens.max()}")
        if tokens.shape[1] > self.cfg.max_len:
            raise ValueError(
                f"{name}: expected at most max_len={self.cfg.max_len} tokens, got {tokens.shape[1]} "
                f"(shape {tuple(tokens.shape)}); shorten the sentence or build the model with a larger max_len"
            )

    def src_mask(self, src: Int[Tensor, "batch src_pos"]) -> Bool[Tensor, "batch 1 1 src_pos"]:
        """Which source positions may be attended to: every real token, no padding."""
        return padding_mask(src, self.cfg.pad_id)

    def encode(self, src: Int[Tensor, "batch src_pos"]) -> Float[Tensor, "batch src_pos d_model"]:
        """The encoder's output (the "memory" the decoder attends to)."""
        self._validate_tokens("src", src, self.cfg.src_vocab)
        x = self.src_embed(src)
        mask = self.src_mask(src)
        for block in self.encoder:
            x = block(x, mask)
        return self.ln_enc(x) if self.cfg.norm == "pre" else x

    def decode(
        self,
        tgt: Int[Tensor, "batch tgt_pos"],
        memory: Float[Tensor, "batch src_pos d_model"],
        src_mask: Bool[Tensor, "batch 1 1 src_pos"] | None,
    ) -> Float[Tensor, "batch tgt_pos tgt_vocab"]:
        """Logits for the token after each target position, given the encoder's memory."""
        self._validate_tokens("tgt", tgt, self.cfg.tgt_vocab)
        x = self.tgt_embed(tgt)
        tgt_mask = causal_mask(tgt.shape[1], device=tgt.device) & padding_mask(tgt, self.cfg.pad_id)
        for block in self.decoder:
            x = block(x, memory, tgt_mask, src_mask)
        if self.cfg.norm == "pre":
            x = self.ln_dec(x)
        W_U = self.tgt_embed.W_E.T if self.cfg.tie_embeddings else self.W_U
        return x @ W_U + self.b_U

    def forward(
        self, src: Int[Tensor, "batch src_pos"], tgt: Int[Tensor, "batch tgt_pos"]
    ) -> Float[Tensor, "batch tgt_pos tgt_vocab"]:
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"tgt: expected batch size {src.shape[0]} (the batch size of src), got {tgt.shape[0]}")
        return self.decode(tgt, self.encode(src), self.src_mask(src))


def label_smoothed_cross_entropy(
    logits: Float[Tensor, "batch pos vocab"],
    targets: Int[Tensor, "batch pos"],
    *,
    smoothing: float = 0.1,
    ignore_index: int | None = None,
) -> Float[Tensor, ""]:
    """Cross-entropy against a softened target: 1 - smoothing on the right token, smoothing spread evenly.

    The target distribution is `(1 - smoothing) * one_hot + smoothing / vocab` (Szegedy et al., 2016),
    so the loss is `(1 - smoothing) * nll + smoothing * mean(-log p)` over the vocabulary. Positions
    whose target is `ignore_index` (padding) do not count.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets: expected shape {tuple(logits.shape[:-1])} (logits without the vocab dim), got {tuple(targets.shape)}"
        )
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing: expected a value in [0, 1), got {smoothing}")
    log_probs = logits.float().log_softmax(dim=-1)
    keep = torch.ones_like(targets, dtype=torch.bool) if ignore_index is None else targets != ignore_index
    safe_targets = targets.masked_fill(~keep, 0)
    nll = -log_probs.gather(-1, safe_targets[..., None]).squeeze(-1)
    uniform = -log_probs.mean(dim=-1)
    loss = (1 - smoothing) * nll + smoothing * uniform
    return (loss * keep).sum() / keep.sum().clamp(min=1)


def _check_decode_args(
    model: EncoderDecoderTransformer,
    src: Tensor,
    max_len: int,
    bos_id: int | None = None,
    eos_id: int | None = None,
) -> None:
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= model.cfg.max_len:
        raise ValueError(f"max_len: expected an int in [1, {model.cfg.max_len}] (the model's max_len), got {max_len!r}")
    model._validate_tokens("src", src, model.cfg.src_vocab)
    # An eos_id the model cannot emit would let every row run on to max_len.
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if value is not None:
            validate.token_id(name, value, model.cfg.tgt_vocab)


@torch.no_grad()
def next_token_logits(
    model: EncoderDecoderTransformer,
    tgt: Int[Tensor, "batch tgt_pos"],
    memory: Float[Tensor, "batch src_pos d_model"],
    src_mask: Bool[Tensor, "batch 1 1 src_pos"],
) -> Float[Tensor, "batch tgt_vocab"]:
    """The decoder's logits for the token after `tgt`. NaN or inf (broken weights) is an error:
    argmax would silently read a row of NaN as token 0."""
    logits = model.decode(tgt, memory, src_mask)[:, -1]
    if not logits.isfinite().all():
        raise FloatingPointError("model: the decoder's logits are not finite; check its weights and the input")
    return logits


def greedy_decode(
    model: EncoderDecoderTransformer, src: Int[Tensor, "batch src_pos"], *, bos_id: int, eos_id: int, max_len: int
) -> list[list[int]]:
    """Translate by always taking the most likely next token; at most `max_len` tokens per row.

    Returns one list of ids per source row, without the start and end tokens.
    """
    _check_decode_args(model, src, max_len, bos_id, eos_id)
    was_training = model.training
    model.eval()
    memory, src_mask = model.encode(src), model.src_mask(src)
    ys = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
    finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
    for _ in range(max_len):
        next_token = next_token_logits(model, ys, memory, src_mask).argmax(dim=-1)
        next_token = next_token.masked_fill(finished, model.cfg.pad_id)
        ys = torch.cat([ys, next_token[:, None]], dim=1)
        finished |= next_token == eos_id
        if finished.all():
            break
    model.train(was_training)
    out = []
    for row in ys[:, 1:].tolist():
        out.append(row[: row.index(eos_id)] if eos_id in row else row)
    return out


@torch.no_grad()
def beam_search(
    model: EncoderDecoderTransformer,
    src: Int[Tensor, "batch src_pos"],
    *,
    bos_id: int,
    eos_id: int,
    max_len: int,
    beam_size: int = 4,
    length_penalty: float = 0.6,
) -> list[list[int]]:
    """Keep the `beam_size` most likely partial translations at each step; return the best finished one.

    Hypotheses are ranked by total log-probability divided by `length ** length_penalty`, so
    longer translations are not unfairly punished for having more factors below one. With
    `beam_size=1` this is greedy decoding.
    """
    _check_decode_args(model, src, max_len, bos_id, eos_id)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size: expected a positive int, got {beam_size!r}")
    was_training = model.training
    model.eval()
    results = []
    for row in src:
        row = row[None]
        memory, src_mask = model.encode(row), model.src_mask(row)
        beams = torch.full((1, 1), bos_id, dtype=torch.long, device=src.device)
        scores = torch.zeros(1, device=src.device)
        finished: list[tuple[float, list[int]]] = []
        for step in range(max_len):
            n = beams.shape[0]
            log_probs = next_token_logits(model, beams, memory.expand(n, -1, -1), src_mask.expand(n, -1, -1, -1))
            candidates = (scores[:, None] + log_probs.float().log_softmax(dim=-1)).flatten()
            top_scores, top_ids = candidates.topk(min(2 * beam_size, candidates.numel()))
            vocab = log_probs.shape[-1]
            keep_beam, keep_token, keep_score = [], [], []
            for score, index in zip(top_scores.tolist(), top_ids.tolist()):
                beam, token = divmod(index, vocab)
                if token == eos_id:
                    finished.append((score / (step + 1) ** length_penalty, beams[beam, 1:].tolist()))
                else:
                    keep_beam.append(beam)
                    keep_token.append(token)
                    keep_score.append(score)
                if len(keep_beam) == beam_size:
                    break
            if len(finished) >= beam_size or not keep_beam:
                break
            index = torch.tensor(keep_beam, device=src.device)
            beams = torch.cat([beams[index], torch.tensor(keep_token, device=src.device)[:, None]], dim=1)
            scores = torch.tensor(keep_score, device=src.device)
        if not finished:  # nothing ended within max_len: fall back to the live beams
            length = beams.shape[1] - 1
            finished = [(s / length**length_penalty, b[1:]) for s, b in zip(scores.tolist(), beams.tolist())]
        results.append(max(finished, key=lambda item: item[0])[1])
    model.train(was_training)
    return results


def translate(
    model: EncoderDecoderTransformer,
    sentences: Sequence[str],
    src_tokenizer: Any,
    tgt_tokenizer: Any | None = None,
    *,
    beam_size: int = 1,
    max_len: int | None = None,
    batch_size: int = 64,
) -> list[str]:
    """Translate strings to strings: tokenize, decode greedily (`beam_size=1`) or with a beam, detokenize.

    The tokenizers must carry the special tokens `<pad> <s> </s>`; one tokenizer serves both sides
    when the vocabulary is shared. `max_len=None` means the model's maximum.
    """
    if isinstance(sentences, str):
        raise TypeError("sentences: expected a list of strings, got a single string (wrap it in a list)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    tgt_tokenizer = tgt_tokenizer or src_tokenizer
    for name, tokenizer, tokens in (
        ("src_tokenizer", src_tokenizer, (EOS,)),
        ("tgt_tokenizer", tgt_tokenizer, (BOS, EOS)),
    ):
        missing = [t for t in tokens if t not in getattr(tokenizer, "special_tokens", {})]
        if missing:
            raise ValueError(
                f"{name}: expected the special tokens {list(tokens)}, missing {missing}"
            )
    bos_id, eos_id = tgt_tokenizer.special_tokens[BOS], tgt_tokenizer.special_tokens[EOS]
    device = next(model.parameters()).device
    max_len = model.cfg.max_len if max_len is None else max_len
    out: list[str] = []
    for start in range(0, len(sentences), batch_size):
        ids = [src_tokenizer.encode(s) + [src_tokenizer.special_tokens[EOS]] for s in sentences[start : start + batch_size]]
        src = pad_batch(ids, model.cfg.pad_id).to(device)
        if beam_size == 1:
            decoded = greedy_decode(model, src, bos_id=bos_id, eos_id=eos_id, max_len=max_len)
        else:
            decoded = beam_search(model, src, bos_id=bos_id, eos_id=eos_id, max_len=max_len, beam_size=beam_size)
        out += [tgt_tokenizer.decode(d) for d in decoded]
    return out


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> Int[Tensor, "batch pos"]:
    """Right-pad lists of ids to the longest one."""
    width = max(len(s) for s in sequences)
    return torch.tensor([list(s) + [pad_id] * (width - len(s)) for s in sequences], dtype=torch.long)


def seq2seq_loss(
    model: nn.Module, batch: tuple[Tensor, Tensor, Tensor], *, smoothing: float = 0.1, pad_id: int = 0
) -> Float[Tensor, ""]:
    """Teacher forcing: feed `<s> y1 .. yn`, predict `y1 .. yn </s>`; label-smoothed, padding ignored."""
    src, tgt_in, tgt_out = batch
    return label_smoothed_cross_entropy(model(src, tgt_in), tgt_out, smoothing=smoothing, ignore_index=pad_id)
