"""An attention-only transformer: chapter 6's GPT-2 without its MLPs (Elhage et al., 2021).

With no MLP, every path from a token to a logit goes through attention heads only, so what
the model computes can be read from its weights: the direct path `W_E W_U`, each head's OV
and QK circuits, and the compositions of heads across layers. Two layers of it are the
smallest model in which induction heads form (Olsson et al., 2022).

Built from the course's parts: chapter 6's `Embed`, `PosEmbed` and `Unembed`, chapter 2's
`MultiHeadAttention`, chapter 5's `residual_sublayer` and chapter 4's `LayerNorm`. Parameter
and hook names follow TransformerLens (`blocks.{l}.attn.hook_pattern`, `hook_embed`, ...),
and `to_hooked_transformer` gives the `HookedTransformer` with `attn_only=True` that computes
the same logits. Layer norms are optional (`normalization_type="LN"` or `None`, as in
TransformerLens): without them every path is linear apart from the attention patterns.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens import HookedTransformer, HookedTransformerConfig
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.attention import MultiHeadAttention
from transformer_course.blocks import residual_sublayer
from transformer_course.gpt2 import Embed, PosEmbed, Unembed
from transformer_course.layernorm import LayerNorm

__all__ = [
    "AttentionOnlyConfig",
    "AttentionOnlyBlock",
    "AttentionOnlyTransformer",
    "to_hooked_transformer",
]

NORMALIZATION_TYPES = ("LN", None)


@dataclass
class AttentionOnlyConfig:
    """The shape of an attention-only transformer; field names follow TransformerLens.

    `d_head` defaults to `d_model // n_heads`. `normalization_type` is "LN" (a layer norm
    before each attention and before the unembedding, as in GPT-2) or None (no norms).

    Course: chapter 10.
    """

    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_head: int | None = None
    d_vocab: int = 64
    n_ctx: int = 64
    normalization_type: str | None = None
    layer_norm_eps: float = 1e-5
    init_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_vocab", "n_ctx"):
            validate.positive_int(name, getattr(self, name))
        self.d_head = validate.head_size(self.d_model, self.n_heads, self.d_head)
        if self.normalization_type not in NORMALIZATION_TYPES:
            raise ValueError(
                f"normalization_type: expected 'LN' or None, got {self.normalization_type!r}"
            )
        validate.number("layer_norm_eps", self.layer_norm_eps, low=0, low_open=True)
        validate.number("init_range", self.init_range, low=0, low_open=True)


def norm(cfg: AttentionOnlyConfig) -> nn.Module:
    """A layer norm, or the identity when the model has none."""
    if cfg.normalization_type == "LN":
        return LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.Identity()


class AttentionOnlyBlock(HookedRootModule):
    """One causal self-attention wrapped in a pre-LN residual connection, nothing else.

    Course: chapter 10.
    """

    def __init__(self, cfg: AttentionOnlyConfig):
        super().__init__()
        self.ln1 = norm(cfg)
        self.attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.d_head)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]: what attention adds
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]
        self.setup()

    def forward(
        self, resid: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch pos d_model"]:
        resid = self.hook_resid_pre(resid)
        resid = residual_sublayer(
            resid,
            lambda x: self.attn(x, causal=True),
            self.ln1,
            norm="pre",
            dropout=nn.Identity(),
            hook_out=self.hook_attn_out,
        )
        return self.hook_resid_post(resid)


class AttentionOnlyTransformer(HookedRootModule):
    """Embed, add positions, run attention-only blocks, (normalise,) unembed.

    A TransformerLens `HookedRootModule`: `run_with_cache(tokens)` returns the logits and every
    activation under TransformerLens's names, `run_with_hooks` edits them.

    Course: chapter 10.
    """

    def __init__(self, cfg: AttentionOnlyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.pos_embed = PosEmbed(cfg)
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList(AttentionOnlyBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_final = norm(cfg)
        self.unembed = Unembed(cfg)
        for block in self.blocks:  # GPT-2's initialisation, as chapter 6's model has it
            for weight in (block.attn.W_Q, block.attn.W_K, block.attn.W_V, block.attn.W_O):
                nn.init.normal_(weight, std=cfg.init_range)
        self.setup()

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab"]:
        validate.token_tensor("tokens", tokens, self.cfg.d_vocab, n_ctx=self.cfg.n_ctx)
        residual = self.hook_embed(self.embed(tokens)) + self.hook_pos_embed(self.pos_embed(tokens))
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))


def to_hooked_transformer(model: AttentionOnlyTransformer) -> HookedTransformer:
    """The TransformerLens `HookedTransformer` (`attn_only=True`, no weight processing) holding
    `model`'s weights, on its device and in its dtype: the same logits and activations.

    Course: chapter 10.
    """
    if not isinstance(model, AttentionOnlyTransformer):
        raise TypeError(f"model: expected an AttentionOnlyTransformer, got {type(model).__name__}")
    cfg = model.cfg
    W_E = model.embed.W_E
    tl_cfg = HookedTransformerConfig(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        d_head=cfg.d_head,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx,
        attn_only=True,
        act_fn=None,
        normalization_type=cfg.normalization_type,
        positional_embedding_type="standard",
        eps=cfg.layer_norm_eps,
        dtype=W_E.dtype,
        device=str(W_E.device),
    )
    hooked = HookedTransformer(tl_cfg)
    missing, unexpected = hooked.load_state_dict(model.state_dict(), strict=False)
    missing = [key for key in missing if not key.endswith((".attn.mask", ".attn.IGNORE"))]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    return hooked.eval()
