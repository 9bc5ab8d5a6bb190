"""Direct logit attribution: the logit of the right next token, split into what each part wrote.

The residual stream at the end is a sum: the token and position embeddings, each head's output
`z[head] @ W_O[head]`, each layer's attention bias `b_O` and each MLP's output. The logit of
token `t` is `LN(resid) @ W_U[:, t] + b_U[t]`, and the final layer norm is linear once its
scale (each vector's standard deviation) is frozen at the value the real run had: then
`LN(resid) = sum over parts of (part - mean(part)) / scale * w + b`, and the logit is a sum of
one number per part plus the constant `b @ W_U[:, t] + b_U[t]`. This is what TransformerLens's
`ActivationCache.apply_ln_to_stack` does (Elhage et al., 2021; ARENA 1.2).

The parts sum to the logit exactly (to rounding: 1e-5 in float32, 1e-10 in float64), because
the scale is the one the run used; it is not what the part would give alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import einops
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate
from transformer_course.hooks import activation, hook_names

__all__ = ["attribution_names", "logit_attribution", "unembedding"]


def unembedding(model: HookedRootModule) -> Float[Tensor, "d_model d_vocab"]:
    """The unembedding matrix `W_U` (the transposed token embedding when they are tied)."""
    unembed = model.unembed
    return unembed.W_U if hasattr(unembed, "W_U") else unembed.W_E.T


def attribution_names(model: HookedRootModule) -> list[str]:
    """The activations `logit_attribution` reads: the embeddings, every head's `hook_z`, every
    MLP's output and the final norm's scale (those the model has)."""
    names = ["hook_embed", "hook_pos_embed"]
    for layer in range(model.cfg.n_layers):
        names += [f"blocks.{layer}.attn.hook_z", f"blocks.{layer}.hook_mlp_out"]
    names.append("ln_final.hook_scale")
    known = set(hook_names(model))
    return [name for name in names if name in known]


def logit_attribution(
    model: HookedRootModule, cache: Mapping[str, Tensor], tokens: Int[Tensor, "batch pos"]
) -> tuple[Float[Tensor, "part batch pos_minus_1"], list[str]]:
    """Each part's share of the logit of the next token, at every position but the last.

    Returns the shares `(part, batch, pos - 1)` and the parts' names: "embed", "pos_embed",
    then per layer "L{l}H{h}" for each head, "L{l} b_O" and "L{l} MLP" (where the model has
    them), and last "bias" (the final norm's shift and the unembedding's bias). Summed over
    parts they give `logits[:, :-1]` at the next tokens `tokens[:, 1:]`. The final norm's scale
    is frozen: read from `cache` ("ln_final.hook_scale"), as the run computed it.

    Course: chapter 10, exercise 10.6, checked by checks.interpretability.check_logit_attribution.
    """
    names = attribution_names(model)
    first = activation(cache, names[0])
    if tokens.shape != first.shape[:2]:
        raise ValueError(
            f"tokens: expected shape {tuple(first.shape[:2])} (the cached run's batch, pos), "
            f"got {tuple(tokens.shape)}"
        )
    validate.token_tensor("tokens", tokens, model.cfg.d_vocab)
    parts, labels = [], []
    for name in names:
        act = activation(cache, name).double()
        if name.endswith("hook_z"):
            layer, attn = int(name.split(".")[1]), model.blocks[int(name.split(".")[1])].attn
            heads = einops.einsum(
                act,
                attn.W_O.double(),
                "batch pos head d_head, head d_head d_model -> head batch pos d_model",
            )
            parts += list(heads)
            labels += [f"L{layer}H{head}" for head in range(heads.shape[0])]
            if attn.b_O is not None:
                parts.append(attn.b_O.double().expand_as(heads[0]))
                labels.append(f"L{layer} b_O")
        elif name.endswith("hook_mlp_out"):
            parts.append(act)
            labels.append(f"L{name.split('.')[1]} MLP")
        elif name != "ln_final.hook_scale":
            parts.append(act)
            labels.append(name.removeprefix("hook_"))
    stack = einops.rearrange(parts, "part batch pos d_model -> part batch pos d_model")[:, :, :-1]
    ln, W_U = model.ln_final, unembedding(model).double()
    directions = W_U[:, tokens[:, 1:]]  # (d_model, batch, pos - 1): each next token's column
    bias = model.unembed.b_U.double()[tokens[:, 1:]]
    if hasattr(ln, "w"):  # a norm: centre (LayerNorm), divide by the frozen scale, times w
        if hasattr(ln, "b"):
            stack = stack - stack.mean(dim=-1, keepdim=True)
            bias = bias + einops.einsum(ln.b.double(), directions, "d, d batch pos -> batch pos")
        scale = activation(cache, "ln_final.hook_scale").double()[:, :-1]
        stack = stack / scale * ln.w.double()
    shares = einops.einsum(stack, directions, "part batch pos d, d batch pos -> part batch pos")
    shares = einops.rearrange([*shares, bias], "part batch pos -> part batch pos")
    return shares.to(first.dtype), labels + ["bias"]
