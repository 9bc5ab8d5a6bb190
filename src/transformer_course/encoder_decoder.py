"""The encoder–decoder Transformer of Vaswani et al. (2017), built from the earlier chapters' parts.

The encoder reads the whole source sentence with unmasked self-attention. The decoder writes the
target one token at a time: masked (causal) self-attention over what it has written so far, then
cross-attention to the encoder's output, then an MLP. Both stacks are made of the one
`blocks.TransformerBlock`; its layer norms sit after each residual sum ("post-LN", as in the
paper) or before each sublayer ("pre-LN", `norm="pre"`).

Parameter names follow TransformerLens (`W_E`, `W_U`, `b_U`; attention `W_Q ... b_O`; MLP
`W_in ... b_out`; layer norm `w`, `b`). Decoding lives in `decoding`, the tokenizers, data and
`translate` in `translation`; the names COURSE.md lists here are found here too.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.blocks import ACTIVATIONS, TransformerBlock
from transformer_course.decoding import beam_search, greedy_decode
from transformer_course.layernorm import LayerNorm
from transformer_course.masking import padding_mask

__all__ = [
    "EncoderDecoderTransformer",
    "Seq2SeqConfig",
    "TokenEmbedding",
    "beam_search",
    "greedy_decode",
    "label_smoothed_cross_entropy",
    "sinusoidal_positional_encoding",
]

# Token tensors must be signed integers: indexing with uint8 or bool selects by mask instead.
TOKEN_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)
D_MLP_DEFAULT = 2048


@dataclass
class Seq2SeqConfig:
    """Sizes of the model; the defaults are the paper's base model.

    `d_mlp` is the MLP's width, which the paper calls `d_ff`: `Seq2SeqConfig(d_ff=...)` sets it
    too, and `cfg.d_ff` reads it. `norm` is `"post"` (the paper) or `"pre"`.
    `share_embeddings` uses one embedding matrix for source and target (needs one shared
    vocabulary); `tie_embeddings` reuses the target embedding as the output projection
    (Press & Wolf, 2017).

    Course: chapter 5.
    """

    src_vocab: int
    tgt_vocab: int
    d_model: int = 512
    n_heads: int = 8
    n_layers: int = 6
    d_mlp: int = D_MLP_DEFAULT
    dropout: float = 0.1
    max_len: int = 256
    pad_id: int = 0
    norm: str = "post"
    act_fn: str = "relu"
    layer_norm_eps: float = 1e-5
    share_embeddings: bool = False
    tie_embeddings: bool = False
    d_ff: InitVar[int | None] = None  # the paper's name for d_mlp, accepted as a keyword

    def __post_init__(self, d_ff: int | None) -> None:
        if d_ff is not None:
            if self.d_mlp not in (D_MLP_DEFAULT, d_ff):
                raise ValueError(
                    f"d_ff: the paper's name for d_mlp; give one of them, got d_ff={d_ff!r} "
                    f"and d_mlp={self.d_mlp!r}"
                )
            self.d_mlp = d_ff
        sizes = ("src_vocab", "tgt_vocab", "d_model", "n_heads", "n_layers", "d_mlp", "max_len")
        for name in sizes:
            validate.positive_int(name, getattr(self, name))
        if self.d_model % 2:
            raise ValueError(
                f"d_model: expected an even size (sin and cos come in pairs), got {self.d_model}"
            )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model: expected a multiple of n_heads={self.n_heads}, got {self.d_model}"
            )
        validate.probability("dropout", self.dropout)
        validate.one_of("norm", self.norm, ("post", "pre"))
        validate.one_of("act_fn", self.act_fn, ACTIVATIONS)
        validate.norm_args(self.d_model, self.layer_norm_eps)
        validate.token_id("pad_id", self.pad_id, min(self.src_vocab, self.tgt_vocab))
        if self.share_embeddings and self.src_vocab != self.tgt_vocab:
            raise ValueError(
                f"share_embeddings: needs src_vocab == tgt_vocab, got {self.src_vocab} and "
                f"{self.tgt_vocab}"
            )


# Read back under the paper's name too (a dataclass field cannot have two names).
Seq2SeqConfig.d_ff = property(lambda cfg: cfg.d_mlp, doc="The paper's name for `d_mlp`.")


def sinusoidal_positional_encoding(
    max_len: int,
    d_model: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Float[Tensor, "pos d_model"]:
    """The paper's fixed position vectors: PE[pos, 2i] = sin(pos / 10000^(2i/d_model)) and
    PE[pos, 2i+1] = cos(pos / 10000^(2i/d_model)).

    Each pair of dimensions is a clock turning at its own frequency, from one turn every 2π
    positions down to one every 10000·2π, so nearby positions get similar vectors and
    PE[pos + k] is a fixed rotation of PE[pos].

    Course: chapter 5, exercise 5.1, checked by checks.encoder_decoder.check_positional_encoding.
    """
    position = torch.arange(max_len, dtype=torch.float64, device=device)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
    angles = position * 10000.0 ** (-two_i / d_model)  # (pos, d_model / 2)
    pe = torch.zeros(max_len, d_model, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe.to(dtype)


class TokenEmbedding(nn.Module):
    """Token embedding times sqrt(d_model), plus the sinusoidal position, then dropout.

    The scale matters: embeddings are initialised with standard deviation 1/sqrt(d_model), so
    without it the position signal (entries of size ~1) would drown the token's identity.

    Course: chapter 5, exercise 5.2, checked by checks.encoder_decoder.check_token_embedding.
    """

    def __init__(self, vocab: int, d_model: int, max_len: int, dropout: float = 0.0):
        super().__init__()
        self.d_model, self.max_len = d_model, max_len
        self.W_E = nn.Parameter(torch.randn(vocab, d_model) * d_model**-0.5)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        if tokens.shape[-1] > self.max_len:
            raise ValueError(
                f"tokens: expected at most max_len={self.max_len} positions, got "
                f"{tokens.shape[-1]} (shape {tuple(tokens.shape)}); shorten the sentence or "
                "build the model with a larger max_len"
            )
        x = self.W_E[tokens] * math.sqrt(self.d_model)
        pe = sinusoidal_positional_encoding(
            tokens.shape[-1], self.d_model, dtype=x.dtype, device=x.device
        )
        return self.dropout(x + pe)


class EncoderDecoderTransformer(nn.Module):
    """Source tokens in, next-target-token logits out:
    `forward(src, tgt) -> (batch, tgt_len, tgt_vocab)`.

    The encoder is a stack of non-causal `TransformerBlock`s; the decoder a stack of causal ones
    with cross-attention to the encoder's output.

    Course: chapter 5, exercise 5.5, checked by checks.encoder_decoder.check_encoder_decoder.
    """

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.cfg = cfg
        self.src_embed = TokenEmbedding(cfg.src_vocab, cfg.d_model, cfg.max_len, cfg.dropout)
        self.tgt_embed = (
            self.src_embed
            if cfg.share_embeddings
            else TokenEmbedding(cfg.tgt_vocab, cfg.d_model, cfg.max_len, cfg.dropout)
        )

        def block(*, decoder: bool) -> TransformerBlock:
            """The decoder's blocks are causal and attend to the encoder's output."""
            d_head = cfg.d_model // cfg.n_heads
            return TransformerBlock(
                cfg.d_model,
                cfg.n_heads,
                d_head,
                cfg.d_mlp,
                layer_norm_eps=cfg.layer_norm_eps,
                norm=cfg.norm,
                act_fn=cfg.act_fn,
                dropout=cfg.dropout,
                causal=decoder,
                cross_attention=decoder,
            )

        self.encoder = nn.ModuleList(block(decoder=False) for _ in range(cfg.n_layers))
        self.decoder = nn.ModuleList(block(decoder=True) for _ in range(cfg.n_layers))
        # Pre-LN leaves the residual stream unnormalised, so each stack ends with a layer norm.
        if cfg.norm == "pre":
            self.ln_enc = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
            self.ln_dec = LayerNorm(cfg.d_model, cfg.layer_norm_eps)
        if not cfg.tie_embeddings:
            self.W_U = nn.Parameter(torch.randn(cfg.d_model, cfg.tgt_vocab) * cfg.d_model**-0.5)
        self.b_U = nn.Parameter(torch.zeros(cfg.tgt_vocab))

    def _validate_tokens(self, name: str, tokens: Any, vocab: int) -> None:
        if not isinstance(tokens, Tensor) or tokens.ndim != 2 or tokens.dtype not in TOKEN_DTYPES:
            got = (
                f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}"
                if isinstance(tokens, Tensor)
                else type(tokens).__name__
            )
            raise ValueError(
                f"{name}: expected an integer tensor (int64, int32, ...) of shape (batch, pos), "
                f"got {got}"
            )
        if tokens.shape[1] == 0:
            raise ValueError(
                f"{name}: expected at least one position, got shape {tuple(tokens.shape)}"
            )
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= vocab):
            raise ValueError(
                f"{name}: expected ids in [0, {vocab}), got values from {tokens.min()} to "
                f"{tokens.max()}"
            )
        if tokens.shape[1] > self.cfg.max_len:
            raise ValueError(
                f"{name}: expected at most max_len={self.cfg.max_len} tokens, got "
                f"{tokens.shape[1]} (shape {tuple(tokens.shape)}); shorten the sentence or "
                "build the model with a larger max_len"
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
        """Logits for the token after each target position, given the encoder's memory. The
        decoder blocks are causal; the target's padding mask hides its padding besides."""
        self._validate_tokens("tgt", tgt, self.cfg.tgt_vocab)
        x = self.tgt_embed(tgt)
        tgt_mask = padding_mask(tgt, self.cfg.pad_id)
        for block in self.decoder:
            x = block(x, tgt_mask, context=memory, context_mask=src_mask)
        if self.cfg.norm == "pre":
            x = self.ln_dec(x)
        W_U = self.tgt_embed.W_E.T if self.cfg.tie_embeddings else self.W_U
        return x @ W_U + self.b_U

    def forward(
        self, src: Int[Tensor, "batch src_pos"], tgt: Int[Tensor, "batch tgt_pos"]
    ) -> Float[Tensor, "batch tgt_pos tgt_vocab"]:
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(
                f"tgt: expected batch size {src.shape[0]} (the batch size of src), "
                f"got {tgt.shape[0]}"
            )
        return self.decode(tgt, self.encode(src), self.src_mask(src))


def label_smoothed_cross_entropy(
    logits: Float[Tensor, "batch pos vocab"],
    targets: Int[Tensor, "batch pos"],
    *,
    smoothing: float = 0.1,
    ignore_index: int | None = None,
) -> Float[Tensor, ""]:
    """Cross-entropy against a softened target: 1 - smoothing on the right token, smoothing
    spread evenly over the vocabulary.

    The target distribution is `(1 - smoothing) * one_hot + smoothing / vocab` (Szegedy et al.,
    2016), so the loss is `(1 - smoothing) * nll + smoothing * mean(-log p)` over the
    vocabulary. Positions whose target is `ignore_index` (padding) do not count.

    Course: chapter 5, exercise 5.6, checked by checks.encoder_decoder.check_label_smoothing.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets: expected shape {tuple(logits.shape[:-1])} (logits without the vocab "
            f"dim), got {tuple(targets.shape)}"
        )
    validate.probability("smoothing", smoothing)
    log_probs = logits.float().log_softmax(dim=-1)
    keep = (
        torch.ones_like(targets, dtype=torch.bool)
        if ignore_index is None
        else targets != ignore_index
    )
    safe_targets = targets.masked_fill(~keep, 0)
    nll = -log_probs.gather(-1, safe_targets[..., None]).squeeze(-1)
    uniform = -log_probs.mean(dim=-1)
    loss = (1 - smoothing) * nll + smoothing * uniform
    return (loss * keep).sum() / keep.sum().clamp(min=1)


def __getattr__(name: str) -> Any:
    """`translate` (strings to strings) lives in `translation`, beside the tokenizers and the
    special tokens it needs; that module builds on this one, so it is imported on first use."""
    if name == "translate":
        from transformer_course.translation import translate

        return translate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
