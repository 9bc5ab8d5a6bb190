"""Hugging Face's Llama weights in the course's layout: a state dict that `Llama.load_state_dict`
takes. (Its config becomes a `LlamaConfig` with `LlamaConfig.from_huggingface`.)

Hugging Face's `nn.Linear` layers store each weight as `(d_out, d_in)`, the transpose of our
`x @ W` matrices. Its attention keeps the heads side by side along `d_out` (`q_proj` is
`(n_heads * d_head, d_model)`, `k_proj` and `v_proj` `(n_kv_heads * d_head, d_model)`), which we
split per head. Its W_Q and W_K rows are in the halves layout of its `rotate_half`; the course
rotates adjacent pairs, as Meta's code does, so those rows are permuted back
(`rope.halves_to_adjacent`). Nothing has a bias. The names on the course's side follow
TransformerLens's (`W_Q`, `W_gate`, `ln1.w`, ...), but TransformerLens keeps Hugging Face's
halves layout and calls the shared key and value weights `_W_K` and `_W_V`.
"""

from __future__ import annotations

from collections.abc import Mapping

import einops
from torch import Tensor

from transformer_course import validate
from transformer_course.rope import halves_to_adjacent

__all__ = ["convert_hf_llama_state_dict"]


# Ours -> Hugging Face's, within one block: matrices that are transposed, and norms' gains.
TRANSPOSED = {
    "mlp.W_gate": "mlp.gate_proj",
    "mlp.W_in": "mlp.up_proj",
    "mlp.W_out": "mlp.down_proj",
}
GAINS = {"ln1.w": "input_layernorm", "ln2.w": "post_attention_layernorm"}


def convert_hf_llama_state_dict(
    hf_state_dict: Mapping[str, Tensor],
    *,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    tie_embeddings: bool = False,
) -> dict[str, Tensor]:
    """The weights of a Hugging Face `LlamaForCausalLM` (its `state_dict()`) under the course's
    names and shapes, for a `Llama` of `n_layers` blocks with `n_heads` query heads and
    `n_kv_heads` key-value heads.

    With `tie_embeddings` the unembedding is the token embedding (`unembed.W_E`); otherwise
    `unembed.W_U` is `lm_head.weight` transposed. The tensors keep their dtype and device.

    Course: chapter 7.
    """
    prefix = f"model.layers.{n_layers - 1}."
    needed = ("model.embed_tokens.weight", "model.norm.weight", prefix + "self_attn.q_proj.weight")
    what = f"the state dict of a LlamaForCausalLM with n_layers={n_layers}"
    validate.has_keys("hf_state_dict", hf_state_dict, needed, what)
    hf = hf_state_dict
    state = {"embed.W_E": hf["model.embed_tokens.weight"], "ln_final.w": hf["model.norm.weight"]}
    if tie_embeddings:
        state["unembed.W_E"] = state["embed.W_E"]
    else:
        validate.has_keys("hf_state_dict", hf, ["lm_head.weight"], what + " (untied)")
        state["unembed.W_U"] = hf["lm_head.weight"].T
    for layer in range(n_layers):
        src, dst = f"model.layers.{layer}.", f"blocks.{layer}."
        state.update({dst + ours: hf[f"{src}{theirs}.weight"] for ours, theirs in GAINS.items()})
        state.update(
            {dst + ours: hf[f"{src}{theirs}.weight"].T for ours, theirs in TRANSPOSED.items()}
        )
        for name, heads in (("Q", n_heads), ("K", n_kv_heads), ("V", n_kv_heads)):
            weight = hf[f"{src}self_attn.{name.lower()}_proj.weight"]
            if name != "V":  # RoPE rotates queries and keys only
                weight = halves_to_adjacent(weight, heads, dim=0)
            state[f"{dst}attn.W_{name}"] = einops.rearrange(
                weight, "(head d_head) d_model -> head d_model d_head", head=heads
            )
        state[dst + "attn.W_O"] = einops.rearrange(
            hf[src + "self_attn.o_proj.weight"],
            "d_model (head d_head) -> head d_head d_model",
            head=n_heads,
        )
    return state
