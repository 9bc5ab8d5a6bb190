"""GPT-2 (Radford et al., 2019): a decoder-only transformer assembled from the earlier chapters.

Token and position embeddings feed a residual stream; `n_layers` pre-LN blocks (causal
multi-head attention, then an MLP with `gelu_new`) write into it; a final layer norm and the
unembedding turn it into next-token logits. `generate` samples from the model, optionally with
top-k and nucleus filtering; `forward_with_cache` keeps each position's keys and values so a
generation step runs only the new token.

Parameter and hook names follow TransformerLens, so a `HookedTransformer` state dict (without
weight processing) loads with `load_state_dict`, and `run_with_cache` gives activations named
like TransformerLens's own. `GPT2.from_huggingface` copies the weights of a Hugging Face
`GPT2LMHeadModel` (the conversion itself is in `gpt2_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import einops
import torch
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.attention import LayerCache
from transformer_course.blocks import ACTIVATIONS, TransformerBlock
from transformer_course.gpt2_weights import convert_hf_gpt2_state_dict
from transformer_course.layernorm import LayerNorm
from transformer_course.runtime import evaluating
from transformer_course.training import History, lm_loss

__all__ = [
    "GPT2Config",
    "Embed",
    "PosEmbed",
    "Unembed",
    "TiedUnembed",
    "GPT2",
    "generate",
    "top_p_filter",
    "KVCache",
    "forward_with_cache",
    "train_step",
    "train_loop",
    "lm_loss",
]


# Options of Hugging Face's GPT2Config that change the computation away from GPT-2's.
NOT_GPT2 = ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention")


@dataclass
class GPT2Config:
    """The shape of a GPT-2 model; the defaults are GPT-2 small (124M parameters).

    Field names follow TransformerLens's `HookedTransformerConfig`. `d_head` defaults to
    `d_model // n_heads` and `d_mlp` to `4 * d_model`. `dropout` applies to the embeddings and
    inside every block while training (0 = none, as in the released GPT-2 evaluation code).
    `tie_embeddings=True` makes the unembedding the transpose of the token embedding, as in the
    released GPT-2 (off by default, so `W_U` is its own parameter, as in TransformerLens).

    Course: chapter 6.
    """

    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_head: int | None = None
    d_mlp: int | None = None
    d_vocab: int = 50257
    n_ctx: int = 1024
    layer_norm_eps: float = 1e-5
    init_range: float = 0.02
    act_fn: str = "gelu_new"
    dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_vocab", "n_ctx"):
            validate.positive_int(name, getattr(self, name))
        self.d_head = validate.head_size(self.d_model, self.n_heads, self.d_head)
        self.d_mlp = validate.positive_int(
            "d_mlp", 4 * self.d_model if self.d_mlp is None else self.d_mlp
        )
        validate.flag("tie_embeddings", self.tie_embeddings)
        validate.probability("dropout", self.dropout)
        validate.number("layer_norm_eps", self.layer_norm_eps, low=0, low_open=True)
        validate.number("init_range", self.init_range, low=0, low_open=True)
        validate.one_of("act_fn", self.act_fn, ACTIVATIONS)

    @classmethod
    def from_huggingface(cls, hf_config: Any) -> GPT2Config:
        """The `GPT2Config` of a Hugging Face `GPT2Config`, refusing options GPT-2 does not have."""
        for option in NOT_GPT2:
            if getattr(hf_config, option, False):
                raise ValueError(f"hf_config.{option}: expected False (as in GPT-2), got True")
        if not getattr(hf_config, "scale_attn_weights", True):
            raise ValueError("hf_config.scale_attn_weights: expected True (as in GPT-2), got False")
        return cls(
            d_model=hf_config.n_embd,
            n_layers=hf_config.n_layer,
            n_heads=hf_config.n_head,
            d_mlp=hf_config.n_inner or 4 * hf_config.n_embd,
            d_vocab=hf_config.vocab_size,
            n_ctx=hf_config.n_positions,
            layer_norm_eps=hf_config.layer_norm_epsilon,
            init_range=hf_config.initializer_range,
            act_fn=hf_config.activation_function,
        )


class Embed(nn.Module):
    """Token embedding: row `t` of `W_E` is the vector of token id `t`.

    Course: chapter 6, exercise 6.1, checked by checks.gpt2.check_embed.
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        nn.init.normal_(self.W_E, std=cfg.init_range)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        return self.W_E[tokens]


class PosEmbed(nn.Module):
    """Learned position embedding: row `i` of `W_pos` is added at position `i` of every sequence.

    Course: chapter 6, exercise 6.2, checked by checks.gpt2.check_pos_embed.
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        nn.init.normal_(self.W_pos, std=cfg.init_range)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        batch, pos = tokens.shape
        return einops.repeat(self.W_pos[:pos], "pos d_model -> batch pos d_model", batch=batch)


class Unembed(nn.Module):
    """Map the final residual stream to one logit per vocabulary entry: `x @ W_U + b_U`.

    Course: chapter 6, exercise 6.3, checked by checks.gpt2.check_unembed.
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.W_U = nn.Parameter(torch.empty(cfg.d_model, cfg.d_vocab))
        nn.init.normal_(self.W_U, std=cfg.init_range)
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return x @ self.W_U + self.b_U


class TiedUnembed(nn.Module):
    """The unembedding tied to the token embedding: `x @ W_E.T + b_U` (Press & Wolf, 2017).

    One matrix maps ids to vectors and vectors back to logits, saving `d_vocab * d_model`
    parameters; `W_E` is the embedding's own parameter, registered here under a second name.

    Course: chapter 6.
    """

    def __init__(self, embed: Embed):
        super().__init__()
        self.W_E = embed.W_E
        self.b_U = nn.Parameter(torch.zeros(embed.cfg.d_vocab))

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return x @ self.W_E.T + self.b_U


class GPT2(HookedRootModule):
    """GPT-2: embed, add positions, run the blocks, normalise, unembed.

    The model is a TransformerLens `HookedRootModule`: `run_with_cache(tokens)` returns the logits
    and every hooked activation, and `hooks(...)` / `run_with_hooks(...)` patch them.

    Course: chapter 6, exercise 6.4, checked by checks.gpt2.check_gpt2_forward.
    """

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.pos_embed = PosEmbed(cfg)
        self.hook_pos_embed = HookPoint()  # [batch, pos, d_model]
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(
                cfg.d_model,
                cfg.n_heads,
                cfg.d_head,
                cfg.d_mlp,
                layer_norm_eps=cfg.layer_norm_eps,
                norm="pre",
                act_fn=cfg.act_fn,
                dropout=cfg.dropout,
            )
            for _ in range(cfg.n_layers)
        )
        self.ln_final = LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.unembed = TiedUnembed(self.embed) if cfg.tie_embeddings else Unembed(cfg)
        self._init_weights()
        self.register_load_state_dict_pre_hook(self._drop_transformer_lens_buffers)
        self.setup()

    def _init_weights(self) -> None:
        """GPT-2's initialisation: N(0, init_range) matrices, zero biases, unit layer-norm gains,
        and the two projections that write into the residual stream scaled by 1/sqrt(2 n_layers)
        so the stream's variance does not grow with depth."""
        residual_std = self.cfg.init_range / math.sqrt(2 * self.cfg.n_layers)
        for block in self.blocks:
            for name, param in block.named_parameters():
                leaf = name.rsplit(".", 1)[-1]
                if leaf.startswith("W_"):
                    std = residual_std if leaf in ("W_O", "W_out") else self.cfg.init_range
                    nn.init.normal_(param, std=std)
                elif leaf.startswith("b"):
                    nn.init.zeros_(param)
                elif leaf == "w":
                    nn.init.ones_(param)

    @staticmethod
    def _drop_transformer_lens_buffers(
        module: nn.Module, state_dict: dict, prefix: str, *args
    ) -> None:
        """TransformerLens stores each attention layer's causal `mask` and `IGNORE` value as
        buffers; our attention builds its mask on the fly, so those entries carry nothing here."""
        own = module.state_dict().keys()
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if key.endswith((".attn.mask", ".attn.IGNORE")) and key[len(prefix) :] not in own:
                del state_dict[key]

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab"]:
        validate.token_tensor("tokens", tokens, self.cfg.d_vocab, n_ctx=self.cfg.n_ctx)
        embed = self.hook_embed(self.embed(tokens))
        pos_embed = self.hook_pos_embed(self.pos_embed(tokens))
        residual: Float[Tensor, "batch pos d_model"] = self.dropout(embed + pos_embed)
        for block in self.blocks:
            residual = block(residual)
        return self.unembed(self.ln_final(residual))

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Number of parameters (a tied `W_E` counts once); `non_embedding=True` leaves out `W_E`
        and `W_pos` (the usual count for scaling laws)."""
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.embed.W_E.numel() + self.pos_embed.W_pos.numel()
        return total

    @classmethod
    def from_huggingface(cls, hf_model: nn.Module) -> GPT2:
        """A `GPT2` holding the weights of a Hugging Face `GPT2LMHeadModel`, on its device and
        in its dtype (the conversion is `gpt2_weights.convert_hf_gpt2_state_dict`)."""
        validate.hugging_face_model("hf_model", hf_model, "gpt2", "GPT2LMHeadModel")
        cfg = GPT2Config.from_huggingface(hf_model.config)
        state = convert_hf_gpt2_state_dict(
            hf_model.state_dict(), n_layers=cfg.n_layers, n_heads=cfg.n_heads
        )
        model = cls(cfg)
        model.load_state_dict(state)
        W_E = state["embed.W_E"]
        return model.to(device=W_E.device, dtype=W_E.dtype)


def generate(
    model: GPT2,
    tokens: Int[Tensor, "batch pos"],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Int[Tensor, "batch pos_plus_new"]:
    """Extend each row of `tokens` by `max_new_tokens` sampled tokens.

    Each step feeds the last `n_ctx` tokens (a longer prompt is cropped), divides the last
    position's logits by `temperature` (0 means greedy: always the most likely token; a tiny
    temperature tends to greedy), keeps the `top_k` largest logits and then the `top_p` nucleus
    if given, and samples from the softmax. The model runs in eval mode (no dropout). Logits
    that are not finite are an error.

    Course: chapter 6, exercise 6.7, checked by checks.gpt2.check_generate.
    """
    validate.integer("max_new_tokens", max_new_tokens, low=0)
    validate.number("temperature", temperature, low=0)
    if top_k is not None:
        validate.positive_int("top_k", top_k)
    if top_p is not None:
        validate.number("top_p", top_p, low=0, low_open=True, high=1)
    validate.token_tensor("tokens", tokens, model.cfg.d_vocab)
    with evaluating(model):
        for _ in range(max_new_tokens):
            context = tokens[:, -model.cfg.n_ctx :]
            logits: Float[Tensor, "batch d_vocab"] = model(context)[:, -1, :].float()
            validate.finite_logits(logits, f"after {tokens.shape[1]} tokens")
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                # Shifting the maximum to 0 first keeps a tiny temperature from overflowing to inf.
                logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth_largest, float("-inf"))
                if top_p is not None:
                    logits = top_p_filter(logits, top_p)
                probs = logits.softmax(dim=-1)
                next_token = torch.multinomial(probs, num_samples=1, generator=generator)
            tokens = torch.cat([tokens, next_token.to(tokens.dtype)], dim=1)
    return tokens


def top_p_filter(
    logits: Float[Tensor, "batch d_vocab"], top_p: float
) -> Float[Tensor, "batch d_vocab"]:
    """Nucleus sampling's filter (Holtzman et al., 2020): keep, in each row, the fewest most
    likely tokens whose probabilities add up to at least `top_p`; set the others to -inf.

    The token that carries the total past `top_p` is kept, so the most likely token always is.

    Course: chapter 6, exercise 6.6, checked by checks.gpt2.check_top_p_filter.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the mass before it already reaches top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


# Per block: the keys and the values of every position so far, each (batch, n_heads, pos, d_head).
KVCache = list[tuple[Tensor, Tensor]]


def forward_with_cache(
    model: GPT2,
    tokens: Int[Tensor, "batch new"],
    cache: KVCache | None = None,
) -> tuple[Float[Tensor, "batch new d_vocab"], KVCache]:
    """GPT-2's forward pass for `tokens` that continue the positions held in `cache`: returns the
    logits of the new positions and the cache extended by them.

    `cache` is None (nothing comes before `tokens`) or what the previous call returned: for each
    block, the keys and the values of every earlier position, each of shape
    `(batch, n_heads, pos, d_head)`. An earlier position's keys and values never change (it
    attends only to itself and to positions before it), so one generation step runs only the
    new token through the model. The new positions are numbered after the cached ones, and
    each block runs its own forward with its cached keys and values, where each new query
    attends to every cached key and to the new keys up to its own. The logits are those of
    `model(all the tokens so far)` at the new positions. For generation: eval mode, at most
    `n_ctx` positions in all.

    Course: chapter 6, exercise 6.13, checked by checks.gpt2.check_kv_cache.
    """
    cfg = model.cfg
    start = validate.kv_cache(cache, tokens, cfg.n_layers, cfg.n_heads, cfg.d_head)
    validate.token_tensor("tokens", tokens, cfg.d_vocab, n_ctx=cfg.n_ctx, cached=start)
    layers = [LayerCache(*pair) for pair in cache or [(None, None)] * cfg.n_layers]
    residual = model.embed(tokens) + model.pos_embed.W_pos[start : start + tokens.shape[1]]
    for block, layer in zip(model.blocks, layers):
        residual = block(residual, cache=layer)
    return model.unembed(model.ln_final(residual)), [(layer.k, layer.v) for layer in layers]


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: Int[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    *,
    grad_clip: float | None = 1.0,
) -> float:
    """One step of next-token training: forward in train mode, loss, fresh gradients, clip
    their global norm to `grad_clip` (None: no clipping), update; returns the loss.

    Course: chapter 6, exercise 6.11, checked by checks.gpt2.check_train_step.
    """
    model.train()
    loss = lm_loss(model(tokens), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    get_batch: Callable[[int], tuple[Tensor, Tensor]],
    evaluate: Callable[[nn.Module], float],
    *,
    max_steps: int,
    lr_at: Callable[[int], float],
    eval_every: int,
    grad_clip: float | None = 1.0,
) -> History:
    """Train for `max_steps` steps as nanoGPT does: before each step set the learning rate
    `lr_at(step)` (steps count from 0), then take a `train_step` on `get_batch(step)`; after
    every `eval_every` steps and after the last, record `evaluate(model)` (a validation loss,
    measured in eval mode without gradients) and keep a copy of the weights wherever it is the
    lowest so far.

    Returns the `History`: per step its loss and learning rate, the evaluations
    (`{"step": steps done, "val_loss": ...}`), the best one and its weights.

    Course: chapter 6, exercise 6.12, checked by checks.gpt2.check_train_loop.
    """
    validate.positive_int("eval_every", eval_every)
    history = History()
    for step in range(validate.positive_int("max_steps", max_steps)):
        lr = lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = train_step(model, optimizer, *get_batch(step), grad_clip=grad_clip)
        history.step.append(step)
        history.train_loss.append(loss)
        history.lr.append(lr)
        if (step + 1) % eval_every == 0 or step + 1 == max_steps:
            with evaluating(model):
                val_loss = evaluate(model)
            history.evals.append({"step": step + 1, "val_loss": val_loss})
            if not history.best or val_loss < history.best["val_loss"]:
                history.best = {"step": step + 1, "val_loss": val_loss}
                history.best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return history
