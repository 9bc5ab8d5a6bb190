"""A modern decoder (Llama: Touvron et al., 2023): GPT-2 with four parts changed.

- RMSNorm instead of layer norm, still before each sublayer (chapter 4's `RMSNorm`).
- RoPE instead of learned position embeddings: queries and keys are rotated by their position
  inside attention (`transformer_course.rope`), and nothing is added to the residual stream.
- SwiGLU instead of the GELU MLP: `W_out(silu(x W_gate) * (x W_in))`, with `d_mlp` about
  8/3 d_model so that its three matrices hold as many parameters as GPT-2's two of 4 d_model.
- Grouped-query attention: `n_kv_heads` key-value heads, each shared by `n_heads / n_kv_heads`
  query heads, so a KV cache is that many times smaller. `n_kv_heads == n_heads` is multi-head
  attention, `n_kv_heads == 1` multi-query attention.

No layer has a bias, and the unembedding may be tied to the token embedding. Parameter and hook
names follow TransformerLens (`W_Q`, `W_gate`, `hook_rot_q`, ...); `Llama.from_huggingface`
copies the weights of a Hugging Face `LlamaForCausalLM` (the conversion is in `llama_weights`),
and `llama_forward_with_cache` runs generation steps on a KV cache, as
`gpt2.forward_with_cache` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.attention import LayerCache, attention_scores, causal_mask, fill_masked
from transformer_course.gpt2 import Embed, KVCache
from transformer_course.layernorm import RMSNorm
from transformer_course.llama_weights import convert_hf_llama_state_dict
from transformer_course.rope import RotaryEmbedding

__all__ = [
    "LlamaConfig",
    "llama_mlp_size",
    "silu",
    "SwiGLU",
    "GroupedQueryAttention",
    "LlamaBlock",
    "LlamaUnembed",
    "Llama",
    "llama_forward_with_cache",
]


def llama_mlp_size(d_model: int, multiple_of: int = 64) -> int:
    """SwiGLU's width as Meta's Llama code sets it: two thirds of 4 d_model (so SwiGLU's three
    matrices hold as many parameters as a 4 d_model MLP's two), rounded up to a multiple of
    `multiple_of`, which keeps the matrices' shapes friendly to the hardware.

    Meta's Llama 2 7B uses `multiple_of=256`: 4096 -> 11008. The course rounds to 64, which
    stays closer to 8/3 for small models: 768 -> 2048, 4096 -> 10944.

    Course: chapter 7.
    """
    validate.positive_int("d_model", d_model)
    validate.positive_int("multiple_of", multiple_of)
    return multiple_of * math.ceil(int(2 * 4 * d_model / 3) / multiple_of)


# Options of Hugging Face's LlamaConfig that change the computation away from the course's.
NOT_LLAMA = ("attention_bias", "mlp_bias")


@dataclass
class LlamaConfig:
    """The shape of a Llama-style model. The defaults are GPT-2 small's sizes (so the two compare
    like for like) with Llama 2's norm eps and RoPE base.

    `n_kv_heads` (default `n_heads`: multi-head attention) must divide `n_heads`. `d_head`
    defaults to `d_model // n_heads` and must be even (RoPE rotates pairs); `d_mlp` defaults to
    `llama_mlp_size(d_model)`, 8/3 d_model rounded up to a multiple of 64. `rope_theta` is RoPE's
    base, `norm_eps` the RMSNorms' eps; `tie_embeddings=True` makes the unembedding the
    transpose of the token embedding. `init_range` is the standard deviation of the initial
    weights.

    Course: chapter 7.
    """

    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None
    d_head: int | None = None
    d_mlp: int | None = None
    d_vocab: int = 50257
    n_ctx: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_range: float = 0.02

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_vocab", "n_ctx"):
            validate.positive_int(name, getattr(self, name))
        self.d_head = validate.head_size(self.d_model, self.n_heads, self.d_head)
        validate.even("d_head", self.d_head, "RoPE rotates pairs of dims")
        n_kv_heads = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        self.n_kv_heads = validate.divisor("n_kv_heads", n_kv_heads, "n_heads", self.n_heads)
        mlp = llama_mlp_size(self.d_model) if self.d_mlp is None else self.d_mlp
        self.d_mlp = validate.positive_int("d_mlp", mlp)
        validate.number("rope_theta", self.rope_theta, low=0, low_open=True)
        validate.number("norm_eps", self.norm_eps, low=torch.finfo(torch.float32).tiny)
        validate.flag("tie_embeddings", self.tie_embeddings)
        validate.number("init_range", self.init_range, low=0, low_open=True)

    @classmethod
    def from_huggingface(cls, hf_config: Any) -> LlamaConfig:
        """The `LlamaConfig` of a Hugging Face `LlamaConfig`, refusing the options the course's
        model does not have (biases, another activation, scaled RoPE)."""
        found = getattr(hf_config, "model_type", None)
        if found != "llama":
            raise ValueError(f"hf_config.model_type: expected 'llama', got {found!r}")
        for option in NOT_LLAMA:
            if getattr(hf_config, option, False):
                raise ValueError(f"hf_config.{option}: expected False (as in Llama), got True")
        if hf_config.hidden_act not in ("silu", "swish"):  # one function, two names
            act = hf_config.hidden_act
            raise ValueError(f"hf_config.hidden_act: expected 'silu' (or 'swish'), got {act!r}")
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})  # transformers 5
        rope = {**(getattr(hf_config, "rope_scaling", None) or {}), **rope}  # transformers 4
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"hf_config.rope_parameters: expected RoPE type 'default', got {rope}")
        return cls(
            d_model=hf_config.hidden_size,
            n_layers=hf_config.num_hidden_layers,
            n_heads=hf_config.num_attention_heads,
            n_kv_heads=getattr(hf_config, "num_key_value_heads", None),
            d_head=getattr(hf_config, "head_dim", None),
            d_mlp=hf_config.intermediate_size,
            d_vocab=hf_config.vocab_size,
            n_ctx=hf_config.max_position_embeddings,
            rope_theta=rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)),
            norm_eps=hf_config.rms_norm_eps,
            tie_embeddings=bool(hf_config.tie_word_embeddings),
            init_range=hf_config.initializer_range or cls.init_range,  # 0: unset; not for loading
        )


def silu(x: Float[Tensor, "*shape"]) -> Float[Tensor, "*shape"]:
    """SiLU, also called swish: `x * sigmoid(x)`. Like GELU, a ReLU smoothed near 0.

    Course: chapter 7, exercise 7.4, checked by checks.llama.check_silu.
    """
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    """The gated MLP of Llama (Shazeer, 2020): `W_out(silu(x W_gate) * (x W_in))`, no biases.

    The gate `silu(x W_gate)` scales, neuron by neuron, the linear path `x W_in`. Hook points
    as in TransformerLens's `GatedMLP`: `hook_pre` (the gate before silu), `hook_pre_linear`
    (`x W_in`) and `hook_post` (their product, the neurons).

    Course: chapter 7, exercise 7.5, checked by checks.llama.check_swiglu.
    """

    def __init__(self, d_model: int, d_mlp: int, *, init_range: float = 0.02):
        super().__init__()
        self.d_model = validate.positive_int("d_model", d_model)
        self.d_mlp = validate.positive_int("d_mlp", d_mlp)
        self.W_gate = nn.Parameter(torch.empty(d_model, d_mlp))
        self.W_in = nn.Parameter(torch.empty(d_model, d_mlp))
        self.W_out = nn.Parameter(torch.empty(d_mlp, d_model))
        std = validate.number("init_range", init_range, low=0)
        for weight in (self.W_gate, self.W_in, self.W_out):
            nn.init.normal_(weight, std=std)
        self.hook_pre = HookPoint()  # [*batch, d_mlp]: x W_gate, before silu
        self.hook_pre_linear = HookPoint()  # [*batch, d_mlp]: x W_in
        self.hook_post = HookPoint()  # [*batch, d_mlp]: silu(x W_gate) * x W_in

    def forward(self, x: Float[Tensor, "*batch d_model"]) -> Float[Tensor, "*batch d_model"]:
        validate.last_dim("x", x, self.d_model, dtype=self.W_in.dtype)
        pre = self.hook_pre(
            einops.einsum(x, self.W_gate, "... d_model, d_model d_mlp -> ... d_mlp")
        )
        pre_linear = self.hook_pre_linear(
            einops.einsum(x, self.W_in, "... d_model, d_model d_mlp -> ... d_mlp")
        )
        post = self.hook_post(silu(pre) * pre_linear)
        return einops.einsum(post, self.W_out, "... d_mlp, d_mlp d_model -> ... d_model")


class GroupedQueryAttention(HookedRootModule):
    """Causal grouped-query attention with RoPE and no biases (Ainslie et al., 2023).

    `n_heads` query heads share `n_kv_heads` key-value heads: query head `h` reads key-value
    head `h // (n_heads // n_kv_heads)`, as Hugging Face's `repeat_kv` arranges them. Queries
    and keys are rotated by their positions (`RotaryEmbedding`); values are not. Parameters
    `W_Q` `(n_heads, d_model, d_head)`, `W_K` and `W_V` `(n_kv_heads, d_model, d_head)`, `W_O`
    `(n_heads, d_head, d_model)`. Hook points as in TransformerLens: `hook_q` `hook_k` `hook_v`
    `(batch, pos, head, d_head)` (keys and values with `n_kv_heads` heads), `hook_rot_q`
    `hook_rot_k` after RoPE, `hook_attn_scores` `hook_pattern` `(batch, head, q_pos, k_pos)`,
    `hook_z` `(batch, q_pos, head, d_head)`.

    `forward(x, cache=...)` keeps the rotated keys and the values of earlier positions in a
    `LayerCache` (with `n_kv_heads` heads: the saving); the new positions are numbered after
    the cached ones. `fast_path=True` (or `attention.set_fast_path`) calls PyTorch's fused
    attention instead of the einsums; the pattern hooks are then not run.

    Course: chapter 7, exercise 7.6, checked by checks.llama.check_grouped_query_attention.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int | None = None,
        d_head: int | None = None,
        *,
        n_ctx: int = 2048,
        rope_theta: float = 10000.0,
        init_range: float = 0.02,
        fast_path: bool = False,
    ) -> None:
        super().__init__()
        d_head = validate.head_size(d_model, n_heads, d_head)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        validate.divisor("n_kv_heads", n_kv_heads, "n_heads", n_heads)
        self.d_model, self.n_heads, self.n_kv_heads, self.d_head = (
            d_model,
            n_heads,
            n_kv_heads,
            d_head,
        )
        self.fast_path = validate.flag("fast_path", fast_path)
        self.W_Q = nn.Parameter(torch.empty(n_heads, d_model, d_head))
        self.W_K = nn.Parameter(torch.empty(n_kv_heads, d_model, d_head))
        self.W_V = nn.Parameter(torch.empty(n_kv_heads, d_model, d_head))
        self.W_O = nn.Parameter(torch.empty(n_heads, d_head, d_model))
        std = validate.number("init_range", init_range, low=0)
        for weight in (self.W_Q, self.W_K, self.W_V, self.W_O):
            nn.init.normal_(weight, std=std)
        self.rotary = RotaryEmbedding(d_head, n_ctx, rope_theta)
        self.hook_q = HookPoint()  # (batch, q_pos, head, d_head)
        self.hook_k = HookPoint()  # (batch, k_pos, kv_head, d_head)
        self.hook_v = HookPoint()  # (batch, k_pos, kv_head, d_head)
        self.hook_rot_q = HookPoint()  # (batch, q_pos, head, d_head): after RoPE
        self.hook_rot_k = HookPoint()  # (batch, k_pos, kv_head, d_head): after RoPE
        self.hook_attn_scores = HookPoint()  # (batch, head, q_pos, k_pos), masked, before softmax
        self.hook_pattern = HookPoint()  # (batch, head, q_pos, k_pos)
        self.hook_z = HookPoint()  # (batch, q_pos, head, d_head)
        self.setup()

    def forward(
        self, x: Float[Tensor, "batch pos d_model"], *, cache: LayerCache | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        """Each position of `x` attends to itself and to every earlier one (the cached ones too)."""
        validate.attention_input("x", x, self.d_model, self.W_Q.dtype)
        start = 0 if cache is None or cache.k is None else cache.k.shape[-2]
        q, k, v = (
            einops.einsum(x, W, "batch pos d_model, head d_model d_head -> batch pos head d_head")
            for W in (self.W_Q, self.W_K, self.W_V)
        )
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        q = self.hook_rot_q(self._rotate(q, start))
        k = self.hook_rot_k(self._rotate(k, start))
        # Heads become a batch dimension: (batch, head, pos, d_head).
        q, k, v = (einops.rearrange(t, "batch pos head d -> batch head pos d") for t in (q, k, v))
        if cache is not None:
            k, v = cache.extend(k, v)
        # Each key-value head serves `group` query heads in a row: head h reads kv head h // group.
        group = self.n_heads // self.n_kv_heads
        k, v = (
            einops.repeat(t, "batch kv_head pos d -> batch (kv_head group) pos d", group=group)
            for t in (k, v)
        )
        z = self._attend_fused(q, k, v) if self.fast_path else self._attend(q, k, v)
        z = self.hook_z(einops.rearrange(z, "batch head q_pos d -> batch q_pos head d"))
        return einops.einsum(
            z, self.W_O, "batch q_pos head d_head, head d_head d_model -> batch q_pos d_model"
        )

    def _rotate(self, t: Tensor, start: int) -> Tensor:
        """RoPE on `(batch, pos, head, d_head)` vectors at positions `start, start + 1, ...`."""
        t = einops.rearrange(t, "batch pos head d -> batch head pos d")
        t = self.rotary(t, offset=start)
        return einops.rearrange(t, "batch head pos d -> batch pos head d")

    def _attend(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The einsum path: the causal scores and pattern pass their hook points. Scores are
        float32 for half-precision inputs; the pattern has the input's dtype."""
        mask = causal_mask(q.shape[-2], k.shape[-2], device=q.device)
        scores = self.hook_attn_scores(fill_masked(attention_scores(q, k), mask))
        pattern = self.hook_pattern(scores.softmax(dim=-1).to(v.dtype))
        return einops.einsum(pattern, v, "... q_pos k_pos, ... k_pos d_head -> ... q_pos d_head")

    @staticmethod
    def _attend_fused(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """PyTorch's fused kernel; with as many queries as keys it builds no mask itself."""
        if q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mask = causal_mask(q.shape[-2], k.shape[-2], device=q.device)  # queries come last
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class LlamaBlock(HookedRootModule):
    """One decoder block: `x + attn(ln1(x))`, then `+ mlp(ln2(.))`, with RMSNorms before each
    sublayer (pre-norm) and the residual stream itself never normalised. Hook points as in
    TransformerLens's blocks (`hook_resid_pre`, `hook_attn_out`, `hook_resid_mid`, ...).

    Course: chapter 7, exercise 7.7, checked by checks.llama.check_llama_block.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GroupedQueryAttention(
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.d_head,
            n_ctx=cfg.n_ctx,
            rope_theta=cfg.rope_theta,
            init_range=cfg.init_range,
        )
        self.ln2 = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_mlp, init_range=cfg.init_range)
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()  # [batch, pos, d_model]: what attention adds
        self.hook_resid_mid = HookPoint()  # [batch, pos, d_model]
        self.hook_mlp_out = HookPoint()  # [batch, pos, d_model]: what the MLP adds
        self.hook_resid_post = HookPoint()  # [batch, pos, d_model]
        self.setup()

    def forward(
        self, resid: Float[Tensor, "batch pos d_model"], *, cache: LayerCache | None = None
    ) -> Float[Tensor, "batch pos d_model"]:
        """Run the block; `cache` holds the keys and values of earlier positions."""
        resid = self.hook_resid_pre(resid)
        resid = resid + self.hook_attn_out(self.attn(self.ln1(resid), cache=cache))
        resid = self.hook_resid_mid(resid)
        resid = resid + self.hook_mlp_out(self.mlp(self.ln2(resid)))
        return self.hook_resid_post(resid)


class LlamaUnembed(nn.Module):
    """Logits `x @ W_U`, without a bias; given the token embedding, tied to it: `x @ W_E.T`, with
    `W_E` the embedding's own parameter registered here under a second name.

    Course: chapter 7.
    """

    def __init__(self, cfg: LlamaConfig, embed: Embed | None = None):
        super().__init__()
        self.tied = embed is not None
        if embed is None:
            self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
            nn.init.normal_(self.W_U, std=cfg.init_range)
        else:
            self.W_E = embed.W_E

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return x @ (self.W_E.T if self.tied else self.W_U)


class Llama(HookedRootModule):
    """A Llama-style decoder: embed the tokens, run the blocks, RMSNorm, unembed.

    There is no position embedding: each attention layer rotates its queries and keys by their
    positions. Like `GPT2`, a TransformerLens `HookedRootModule`: `run_with_cache(tokens)`
    returns the logits and every hooked activation.

    Course: chapter 7, exercise 7.8, checked by checks.llama.check_llama.
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_final = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.unembed = LlamaUnembed(cfg, self.embed if cfg.tie_embeddings else None)
        self.setup()

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab"]:
        validate.token_tensor("tokens", tokens, self.cfg.d_vocab, n_ctx=self.cfg.n_ctx)
        residual = self.hook_embed(self.embed(tokens))
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))

    @classmethod
    def from_huggingface(cls, hf_model: nn.Module) -> Llama:
        """A `Llama` holding the weights of a Hugging Face `LlamaForCausalLM`, on its device and
        in its dtype (the conversion is `llama_weights.convert_hf_llama_state_dict`)."""
        validate.hugging_face_model("hf_model", hf_model, "llama", "LlamaForCausalLM")
        cfg = LlamaConfig.from_huggingface(hf_model.config)
        state = convert_hf_llama_state_dict(
            hf_model.state_dict(),
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            tie_embeddings=cfg.tie_embeddings,
        )
        W_E = state["embed.W_E"]
        model = cls(cfg).to(device=W_E.device, dtype=W_E.dtype)  # loading copies into its dtype
        model.load_state_dict(state)
        return model


def llama_forward_with_cache(
    model: Llama, tokens: Int[Tensor, "batch new"], cache: KVCache | None = None
) -> tuple[Float[Tensor, "batch new d_vocab"], KVCache]:
    """The model's forward pass for `tokens` that continue the positions held in `cache`: the
    logits of the new positions and the cache extended by them, as `gpt2.forward_with_cache`.

    `cache` is None or what the previous call returned: per block, the rotated keys and the
    values of every earlier position, each `(batch, n_kv_heads, pos, d_head)`. Each block runs
    its own forward with its cached keys and values, and RoPE numbers the new positions after
    the cached ones, so the logits are those of `model(all the tokens so far)` at the new
    positions. For generation: eval mode, at most `n_ctx` positions in all.

    Course: chapter 7.
    """
    cfg = model.cfg
    start = validate.kv_cache(cache, tokens, cfg.n_layers, cfg.n_kv_heads, cfg.d_head)
    validate.token_tensor("tokens", tokens, cfg.d_vocab, n_ctx=cfg.n_ctx, cached=start)
    layers = [LayerCache(*pair) for pair in cache or [(None, None)] * cfg.n_layers]
    residual = model.embed(tokens)
    for block, layer in zip(model.blocks, layers):
        residual = block(residual, cache=layer)
    return model.unembed(model.ln_final(residual)), [(layer.k, layer.v) for layer in layers]
