"""Circuits read from the weights: what a head moves (OV) and where it looks (QK).

In TransformerLens's row-vector convention a head reads `x @ W_V[h]` at each key and writes
`... @ W_O[h]`, so its OV circuit is `W_OV = W_V[h] @ W_O[h]` `(d_model, d_model)`: what a
token attended to adds to the stream. Its attention score between a query vector `x_q` and a
key vector `x_k` is `x_q @ W_QK @ x_k.T` with `W_QK = W_Q[h] @ W_K[h].T`. Multiplied by the
embedding and the unembedding, `W_E @ W_OV @ W_U` `(d_vocab, d_vocab)` says which logits a
head raises for each token it attends to: a copying head's is largest on the diagonal.

Heads compose (Elhage et al., 2021): a later head B's keys can read an earlier head A's output
(K-composition, how an induction head finds "the token after the previous occurrence": A is a
previous-token head). B's score from a query vector `x_q` to a key holding A's output `y @ W_OV_A`
is `x_q @ W_QK_B @ W_OV_A.T @ y.T`, so the composed matrix is `W_QK_B @ W_OV_A.T`, and the
K-composition score is its Frobenius norm over the product of the two norms (Elhage et al.'s
`||W_QK^T W_OV||_F / (||W_QK||_F ||W_OV||_F)`, written there with column vectors).
Q-composition has `W_OV_A` on the query side instead (`W_OV_A @ W_QK_B`), V-composition
`W_OV_A @ W_OV_B`. Layer norms in between are ignored,
as in the paper. Scores equal TransformerLens's `all_composition_scores`.
"""

from __future__ import annotations

import einops
import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.HookedRootModule import HookedRootModule

from transformer_course import validate

__all__ = [
    "ov_circuit",
    "qk_circuit",
    "full_ov_circuit",
    "composition_score",
    "k_composition_scores",
]


def _attn(model: HookedRootModule, layer: int, head: int):
    """Layer `layer`'s attention module, once `layer` and `head` exist."""
    validate.integer("layer", layer, low=0, high=model.cfg.n_layers - 1)
    validate.integer("head", head, low=0, high=model.cfg.n_heads - 1)
    return model.blocks[layer].attn


def ov_circuit(model: HookedRootModule, layer: int, head: int) -> Float[Tensor, "d_model d_model"]:
    """`W_V[head] @ W_O[head]`: what the head writes for each vector it attends to.

    Course: chapter 10.
    """
    attn = _attn(model, layer, head)
    return attn.W_V[head] @ attn.W_O[head]


def qk_circuit(model: HookedRootModule, layer: int, head: int) -> Float[Tensor, "d_model d_model"]:
    """`W_Q[head] @ W_K[head].T`: entry (i, j) weighs query dim i against key dim j.

    Course: chapter 10.
    """
    attn = _attn(model, layer, head)
    return attn.W_Q[head] @ attn.W_K[head].T


def full_ov_circuit(
    model: HookedRootModule, layer: int, head: int
) -> Float[Tensor, "d_vocab d_vocab"]:
    """`W_E @ W_OV @ W_U`: row t, the logits the head adds when it attends to token t (through
    the direct path, the norms left out)."""
    W_U = model.unembed.W_U if hasattr(model.unembed, "W_U") else model.unembed.W_E.T
    return model.embed.W_E @ ov_circuit(model, layer, head) @ W_U


def composition_score(
    W_A: Float[Tensor, "*batch_a d_model d_model"], W_B: Float[Tensor, "*batch_b d_model d_model"]
) -> Float[Tensor, "*batch"]:
    """`||W_A @ W_B||_F / (||W_A||_F ||W_B||_F)`: 1 when B reads all of what A writes, about
    `1 / sqrt(d_model)` for random matrices."""
    for name, W in (("W_A", W_A), ("W_B", W_B)):
        if W.ndim < 2 or W.shape[-1] != W.shape[-2]:
            raise ValueError(
                f"{name}: expected square (d_model, d_model) matrices, got {tuple(W.shape)}"
            )
    norm = lambda W: torch.linalg.matrix_norm(W)  # noqa: E731 (Frobenius over the last two dims)
    return norm(W_A @ W_B) / (norm(W_A) * norm(W_B))


def k_composition_scores(
    model: HookedRootModule, layer_a: int = 0, layer_b: int = 1
) -> Float[Tensor, "head_a head_b"]:
    """The K-composition score of every head of `layer_a` (writing) with every head of the later
    `layer_b` (whose keys read it): entry `[a, b]`.

    Course: chapter 10,
    exercise 10.10, checked by checks.interpretability.check_k_composition_scores.
    """
    validate.integer("layer_a", layer_a, low=0, high=model.cfg.n_layers - 2)
    validate.integer("layer_b", layer_b, low=layer_a + 1, high=model.cfg.n_layers - 1)
    heads = range(model.cfg.n_heads)
    W_OV = torch.stack([ov_circuit(model, layer_a, head) for head in heads])
    W_QK = torch.stack([qk_circuit(model, layer_b, head) for head in heads])
    return composition_score(
        einops.rearrange(W_OV, "a i j -> a 1 i j"),
        einops.rearrange(W_QK.transpose(-1, -2), "b i j -> 1 b i j"),
    )
