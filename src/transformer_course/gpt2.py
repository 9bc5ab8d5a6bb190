"""GPT-2 (Radford et al., 2019): a decoder-only transformer assembled from the earlier chapters.

Token and position embeddings feed a residual stream; `n_layers` pre-LN blocks (causal
multi-head attention, then an MLP with `gelu_new`) write into it; a final layer norm and the
unembedding turn it into next-token logits.

Parameter and hook names follow TransformerLens, so a `HookedTransformer` state dict (without
weight processing) loads with `load_state_dict`, and `run_with_cache` gives activations named
like TransformerLens's own. `GPT2.from_huggingface` copies the weights of a Hugging Face
`GPT2LMHeadModel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import einops
import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course.blocks import TransformerBlock
from transformer_course.layernorm import LayerNorm

__all__ = [
    "GPT2Config",
    "Embed",
    "PosEmbed",
    "Unembed",
    "TiedUnembed",
    "GPT2",
    "validate_tokens",
    "generate",
    "lm_loss",
    "sample_batch",
    "estimate_loss",
]


@dataclass
class GPT2Config:
    """The shape of a GPT-2 model; the defaults are GPT-2 small (124M parameters).

    Field names follow TransformerLens's `HookedTransformerConfig`. `d_head` defaults to
    `d_model // n_heads` and `d_mlp` to `4 * d_model`. `dropout` applies to the embeddings and
    inside every block while training (0 = none, as in the released GPT-2 evaluation code).
    `tie_embeddings=True` makes the unembedding the transpose of the token embedding, as in the
    released GPT-2 (off by default, so `W_U` is its own parameter, as in TransformerLens).
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
        for name in ("d_model", "n_layers", "n_heads", "d_vocab", "n_ctx"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.d_head is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"d_head: not given, and d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
                )
            self.d_head = self.d_model // self.n_heads
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        for name in ("d_head", "d_mlp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings: expected True or False, got {self.tie_embeddings!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps: expected a positive number, got {self.layer_norm_eps}")
        if not self.init_range > 0:
            raise ValueError(f"init_range: expected a positive number, got {self.init_range}")


class Embed(nn.Module):
    """Token embedding: row `t` of `W_E` is the vector of token id `t`."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))
        nn.init.normal_(self.W_E, std=cfg.init_range)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        return self.W_E[tokens]


class PosEmbed(nn.Module):
    """Learned position embedding: row `i` of `W_pos` is added at position `i` of every sequence."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))
        nn.init.normal_(self.W_pos, std=cfg.init_range)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        batch, pos = tokens.shape
        return einops.repeat(self.W_pos[:pos], "pos d_model -> batch pos d_model", batch=batch)


class Unembed(nn.Module):
    """Map the final residual stream to one logit per vocabulary entry: `x @ W_U + b_U`."""

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
    """

    def __init__(self, embed: Embed):
        super().__init__()
        self.W_E = embed.W_E
        self.b_U = nn.Parameter(torch.zeros(embed.cfg.d_vocab))

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_vocab"]:
        return x @ self.W_E.T + self.b_U


TOKEN_DTYPES = (torch.int64, torch.int32)


def validate_tokens(tokens: object, cfg: GPT2Config, *, any_length: bool = False) -> None:
    """Raise a clear error unless `tokens` is an integer `(batch, pos)` tensor the model can read
    (`any_length=True` allows more than `n_ctx` positions, for a caller that crops them)."""
    if not isinstance(tokens, Tensor):
        raise TypeError(f"tokens: expected an integer torch.Tensor of shape (batch, pos), got {type(tokens).__name__}")
    if tokens.dtype not in TOKEN_DTYPES:
        # uint8 and bool tensors would index W_E as a mask, not as ids.
        raise TypeError(f"tokens: expected an integer dtype (torch.long), got {tokens.dtype}")
    if tokens.ndim != 2:
        raise ValueError(f"tokens: expected shape (batch, pos), got {tuple(tokens.shape)}")
    if tokens.shape[1] > cfg.n_ctx and not any_length:
        raise ValueError(
            f"tokens: expected at most n_ctx={cfg.n_ctx} positions, got {tokens.shape[1]} "
            f"(shape {tuple(tokens.shape)}); crop the context to the last n_ctx tokens"
        )
    if tokens.numel() and not torch.compiler.is_compiling():
        low, high = torch.stack(torch.aminmax(tokens)).tolist()  # one device synchronisation
        if low < 0 or high >= cfg.d_vocab:
            raise ValueError(f"tokens: expected ids in [0, d_vocab={cfg.d_vocab}), got ids from {low} to {high}")


class GPT2(HookedRootModule):
    """GPT-2: embed, add positions, run the blocks, normalise, unembed.

    The model is a TransformerLens `HookedRootModule`: `run_with_cache(tokens)` returns the logits
    and every hooked activation, and `hooks(...)` / `run_with_hooks(...)` patch them.
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
    def _drop_transformer_lens_buffers(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
        """TransformerLens stores each attention layer's causal `mask` and `IGNORE` value as
        buffers; our attention builds its mask on the fly, so those entries carry nothing here."""
        own = module.state_dict().keys()
        for key in [k for k in state_dict if k.startswith(prefix)]:
            if key.endswith((".attn.mask", ".attn.IGNORE")) and key[len(prefix) :] not in own:
                del state_dict[key]

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_vocab"]:
        validate_tokens(tokens, self.cfg)
        residual: Float[Tensor, "batch pos d_model"] = self.hook_embed(self.embed(tokens)) + self.hook_pos_embed(
            self.pos_embed(tokens)
        )
        residual = self.dropout(residual)
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
        """A `GPT2` holding the weights of a Hugging Face `GPT2LMHeadModel`.

        Hugging Face's GPT-2 uses `Conv1D` layers whose weight is stored `(d_in, d_out)`, the
        transpose of `nn.Linear` (and the layout of our `x @ W` matrices). Attention keeps Q, K
        and V in one `c_attn` matrix of width `3 * d_model`, which we split and reshape per head.
        The language-model head is tied to the token embedding and has no bias, so `b_U` is zero.
        """
        hf_cfg = getattr(hf_model, "config", None)
        if not isinstance(hf_model, nn.Module) or getattr(hf_cfg, "model_type", None) != "gpt2":
            raise TypeError(
                "hf_model: expected a Hugging Face GPT2LMHeadModel (config.model_type 'gpt2'), got "
                f"{type(hf_model).__name__} with model_type {getattr(hf_cfg, 'model_type', None)!r}"
            )
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if getattr(hf_cfg, flag, False):
                raise ValueError(f"hf_model: config.{flag}=True is not part of GPT-2; expected False")
        if not getattr(hf_cfg, "scale_attn_weights", True):
            raise ValueError("hf_model: config.scale_attn_weights=False is not part of GPT-2; expected True")
        cfg = GPT2Config(
            d_model=hf_cfg.n_embd,
            n_layers=hf_cfg.n_layer,
            n_heads=hf_cfg.n_head,
            d_mlp=hf_cfg.n_inner or 4 * hf_cfg.n_embd,
            d_vocab=hf_cfg.vocab_size,
            n_ctx=hf_cfg.n_positions,
            layer_norm_eps=hf_cfg.layer_norm_epsilon,
            init_range=hf_cfg.initializer_range,
            act_fn=hf_cfg.activation_function,
        )
        hf = hf_model.state_dict()
        last_layer = f"transformer.h.{cfg.n_layers - 1}.attn.c_attn.weight"
        for key in ("transformer.wte.weight", "lm_head.weight", last_layer):
            if key not in hf:
                raise TypeError(f"hf_model: expected a GPT2LMHeadModel, but {key!r} is missing")
        n_heads = cfg.n_heads
        state = {
            "embed.W_E": hf["transformer.wte.weight"],
            "pos_embed.W_pos": hf["transformer.wpe.weight"],
            "ln_final.w": hf["transformer.ln_f.weight"],
            "ln_final.b": hf["transformer.ln_f.bias"],
            "unembed.W_U": hf["lm_head.weight"].T,
            "unembed.b_U": torch.zeros(cfg.d_vocab, dtype=hf["lm_head.weight"].dtype),
        }
        for layer in range(cfg.n_layers):
            src, dst = f"transformer.h.{layer}.", f"blocks.{layer}."
            W_Q, W_K, W_V = hf[src + "attn.c_attn.weight"].chunk(3, dim=1)  # each (d_model, n_heads * d_head)
            b_Q, b_K, b_V = hf[src + "attn.c_attn.bias"].chunk(3, dim=0)
            for name, weight, bias in (("Q", W_Q, b_Q), ("K", W_K, b_K), ("V", W_V, b_V)):
                state[f"{dst}attn.W_{name}"] = einops.rearrange(
                    weight, "d_model (head d_head) -> head d_model d_head", head=n_heads
                )
                state[f"{dst}attn.b_{name}"] = einops.rearrange(bias, "(head d_head) -> head d_head", head=n_heads)
            state[dst + "attn.W_O"] = einops.rearrange(
                hf[src + "attn.c_proj.weight"], "(head d_head) d_model -> head d_head d_model", head=n_heads
            )
            state[dst + "attn.b_O"] = hf[src + "attn.c_proj.bias"]
            state[dst + "ln1.w"] = hf[src + "ln_1.weight"]
            state[dst + "ln1.b"] = hf[src + "ln_1.bias"]
            state[dst + "ln2.w"] = hf[src + "ln_2.weight"]
            state[dst + "ln2.b"] = hf[src + "ln_2.bias"]
            state[dst + "mlp.W_in"] = hf[src + "mlp.c_fc.weight"]
            state[dst + "mlp.b_in"] = hf[src + "mlp.c_fc.bias"]
            state[dst + "mlp.W_out"] = hf[src + "mlp.c_proj.weight"]
            state[dst + "mlp.b_out"] = hf[src + "mlp.c_proj.bias"]
        model = cls(cfg)
        model.load_state_dict(state)
        reference = hf["transformer.wte.weight"]
        return model.to(device=reference.device, dtype=reference.dtype)


@torch.no_grad()
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
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected a non-negative int, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected None or a positive int, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p!r}")
    validate_tokens(tokens, model.cfg, any_length=True)
    if tokens.shape[1] == 0:
        raise ValueError(f"tokens: expected at least one token per row to continue from, got shape {tuple(tokens.shape)}")
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = tokens[:, -model.cfg.n_ctx :]
            logits: Float[Tensor, "batch d_vocab"] = model(context)[:, -1, :].float()
            if not logits.isfinite().all():
                raise FloatingPointError(
                    f"model: its logits after {tokens.shape[1]} tokens are not finite; "
                    "check the weights and the input"
                )
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
    finally:
        model.train(was_training)
    return tokens


def top_p_filter(logits: Float[Tensor, "batch d_vocab"], top_p: float) -> Float[Tensor, "batch d_vocab"]:
    """Nucleus sampling's filter (Holtzman et al., 2020): keep, in each row, the fewest most
    likely tokens whose probabilities add up to at least `top_p`; set the others to -inf.

    The token that carries the total past `top_p` is kept, so the most likely token always is.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the mass before it already reaches top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: Int[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"],
    *,
    grad_clip: float | None = 1.0,
) -> float:
    """One step of next-token training: forward in train mode, loss, fresh gradients, clip
    their global norm to `grad_clip` (None: no clipping), update; returns the loss."""
    model.train()
    loss = lm_loss(model(tokens), targets)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()


def lm_loss(logits: Float[Tensor, "batch pos d_vocab"], targets: Int[Tensor, "batch pos"]) -> Float[Tensor, ""]:
    """Mean cross-entropy of the next-token predictions (`targets` are the inputs shifted by one)."""
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets: expected shape {tuple(logits.shape[:-1])} (logits without d_vocab), got {tuple(targets.shape)}"
        )
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def sample_batch(
    data: Int[Tensor, " n_tokens"],
    batch_size: int,
    block_size: int,
    *,
    generator: torch.Generator | None = None,
) -> tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
    """`batch_size` random windows of `block_size` tokens from `data`, and the same windows
    shifted by one token: the inputs and the targets of next-token prediction."""
    if data.ndim != 1 or data.numel() <= block_size:
        raise ValueError(f"data: expected a 1-d tensor longer than block_size={block_size}, got shape {tuple(data.shape)}")
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    offsets = torch.arange(block_size)
    x = data[starts[:, None] + offsets]
    y = data[starts[:, None] + offsets + 1]
    return x, y


@torch.no_grad()
def estimate_loss(
    model: nn.Module,
    data: Int[Tensor, " n_tokens"],
    *,
    batch_size: int,
    block_size: int,
    n_batches: int,
    generator: torch.Generator | None = None,
) -> float:
    """Mean loss over `n_batches` random batches (nanoGPT's `estimate_loss`), in eval mode."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros((), device=device)
    for _ in range(n_batches):
        x, y = sample_batch(data, batch_size, block_size, generator=generator)
        total += lm_loss(model(x.to(device)), y.to(device))
    model.train(was_training)
    return total.item() / n_batches  # one host synchronisation, not one per batch
