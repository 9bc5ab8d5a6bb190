"""The encoder–decoder Transformer of Vaswani et al. (2017), built from the earlier chapters' parts.

The encoder reads the whole source sentence with unmasked self-attention. The decoder writes the
target one token at a time: masked (causal) self-attention over what it has written so far, then
cross-attention to the encoder's output, then an MLP. Both stacks are made of the one
`blocks.TransformerBlock`; its layer norms sit after each residual sum ("post-LN", as in the
paper) or before each sublayer ("pre-LN", `norm="pre"`).

Parameter names follow TransformerLens (`W_E`, `W_U`, `b_U`; attention `W_Q ... b_O`; MLP
`W_in ... b_out`; layer norm `w`, `b`). Decoding, and `translate` from strings to strings, live
in `decoding` and are importable from here too; the data and the training run in `translation`.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from transformer_course import validate
from transformer_course.blocks import ACTIVATIONS, TransformerBlock
from transformer_course.decoding import beam_search, greedy_decode, translate
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
    "translate",
]

D_MLP_DEFAULT, N_CTX_DEFAULT = 2048, 256


@dataclass
class Seq2SeqConfig:
    """Sizes of the model; the defaults are the paper's base model.

    `d_mlp` is the MLP's width, which the paper calls `d_ff`: `Seq2SeqConfig(d_ff=...)` sets it
    too, and `cfg.d_ff` reads it. `n_ctx` is the most tokens a source or a target may have
    (`max_len` is its former name, accepted and read the same way). `norm` is `"post"` (the
    paper) or `"pre"`.
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
    n_ctx: int = N_CTX_DEFAULT
    pad_id: int = 0
    norm: str = "post"
    act_fn: str = "relu"
    layer_norm_eps: float = 1e-5
    share_embeddings: bool = False
    tie_embeddings: bool = False
    d_ff: InitVar[int | None] = None  # the paper's name for d_mlp, accepted as a keyword
    max_len: InitVar[int | None] = None  # the former name of n_ctx

    def __post_init__(self, d_ff: int | None, max_len: int | None) -> None:
        self.d_mlp = validate.alias("d_ff", d_ff, "d_mlp", self.d_mlp, D_MLP_DEFAULT)
        self.n_ctx = validate.alias("max_len", max_len, "n_ctx", self.n_ctx, N_CTX_DEFAULT)
        _validate_config(self)


# Read back under the other names too (a dataclass field cannot have two names).
Seq2SeqConfig.d_ff = property(lambda cfg: cfg.d_mlp, doc="The paper's name for `d_mlp`.")
Seq2SeqConfig.max_len = property(lambda cfg: cfg.n_ctx, doc="The former name of `n_ctx`.")


def _validate_config(cfg: Seq2SeqConfig) -> None:
    """Every field of `cfg`, so a bad one is named before any model is built."""
    sizes = ("src_vocab", "tgt_vocab", "d_model", "n_heads", "n_layers", "d_mlp", "n_ctx")
    for name in sizes:
        validate.positive_int(name, getattr(cfg, name))
    if cfg.d_model % 2:
        raise ValueError(
            f"d_model: expected an even size (sin and cos come in pairs), got {cfg.d_model}"
        )
    validate.head_size(cfg.d_model, cfg.n_heads)
    validate.probability("dropout", cfg.dropout)
    validate.one_of("norm", cfg.norm, ("post", "pre"))
    validate.one_of("act_fn", cfg.act_fn, ACTIVATIONS)
    validate.norm_args(cfg.d_model, cfg.layer_norm_eps)
    validate.token_id("pad_id", cfg.pad_id, min(cfg.src_vocab, cfg.tgt_vocab))
    if cfg.share_embeddings and cfg.src_vocab != cfg.tgt_vocab:
        raise ValueError(
            f"share_embeddings: needs src_vocab == tgt_vocab, got {cfg.src_vocab} and "
            f"{cfg.tgt_vocab}"
        )


def sinusoidal_positional_encoding(
    seq_len: int,
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

    Course: chapter 5, exercise 5.1, checked by checks.translation.check_positional_encoding.
    """
    position = torch.arange(seq_len, dtype=torch.float64, device=device)[:, None]
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64, device=device)
    angles = position * 10000.0 ** (-two_i / d_model)  # (pos, d_model / 2)
    pe = torch.zeros(seq_len, d_model, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe.to(dtype)


class TokenEmbedding(nn.Module):
    """Token embedding times sqrt(d_model), plus the sinusoidal position, then dropout.

    The scale matters: embeddings are initialised with standard deviation 1/sqrt(d_model), so
    without it the position signal (entries of size ~1) would drown the token's identity.

    Course: chapter 5, exercise 5.2, checked by checks.translation.check_token_embedding.
    """

    def __init__(self, d_vocab: int, d_model: int, dropout: float = 0.0):
        super().__init__()
        self.d_model = d_model
        self.W_E = nn.Parameter(torch.randn(d_vocab, d_model) * d_model**-0.5)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
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

    Course: chapter 5, exercise 5.6, checked by checks.translation.check_encoder_decoder.
    """

    def __init__(self, cfg: Seq2SeqConfig):
        super().__init__()
        self.cfg = cfg
        self.src_embed = TokenEmbedding(cfg.src_vocab, cfg.d_model, cfg.dropout)
        self.tgt_embed = (
            self.src_embed
            if cfg.share_embeddings
            else TokenEmbedding(cfg.tgt_vocab, cfg.d_model, cfg.dropout)
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

    def src_mask(self, src: Int[Tensor, "batch src_pos"]) -> Bool[Tensor, "batch 1 1 src_pos"]:
        """Which source positions may be attended to: every real token, no padding."""
        return padding_mask(src, self.cfg.pad_id)

    def encode(self, src: Int[Tensor, "batch src_pos"]) -> Float[Tensor, "batch src_pos d_model"]:
        """The encoder's output (the "memory" the decoder attends to)."""
        validate.token_tensor("src", src, self.cfg.src_vocab, n_ctx=self.cfg.n_ctx)
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
        validate.token_tensor("tgt", tgt, self.cfg.tgt_vocab, n_ctx=self.cfg.n_ctx)
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
        validate.same_batch("tgt", tgt, src, "src")
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

    Course: chapter 5, exercise 5.7, checked by checks.translation.check_label_smoothing.
    """
    validate.targets(targets, logits)
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
