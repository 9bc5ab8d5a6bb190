"""Hugging Face's GPT-2 weights in the course's layout: a state dict that `GPT2.load_state_dict`
takes. (Its config becomes a `GPT2Config` with `GPT2Config.from_huggingface`.)

Hugging Face keeps OpenAI's TensorFlow layout. Its `Conv1D` layers store each weight as
`(d_in, d_out)`, the transpose of `nn.Linear` and the layout of our `x @ W` matrices, so no
transpose is needed; attention keeps Q, K and V side by side in one `c_attn` matrix of width
`3 * d_model`, which we split and reshape per head; the language-model head is tied to the
token embedding and has no bias. The names on the course's side are TransformerLens's (its own
conversion is `transformer_lens.pretrained.weight_conversions.convert_gpt2_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping

import einops
from torch import Tensor

from transformer_course import validate

__all__ = ["convert_hf_gpt2_state_dict"]


# Ours -> Hugging Face's, within one block: the parameters that only change name.
RENAMED = {
    "attn.b_O": "attn.c_proj.bias",
    "ln1.w": "ln_1.weight",
    "ln1.b": "ln_1.bias",
    "ln2.w": "ln_2.weight",
    "ln2.b": "ln_2.bias",
    "mlp.W_in": "mlp.c_fc.weight",
    "mlp.b_in": "mlp.c_fc.bias",
    "mlp.W_out": "mlp.c_proj.weight",
    "mlp.b_out": "mlp.c_proj.bias",
}


def convert_hf_gpt2_state_dict(
    hf_state_dict: Mapping[str, Tensor], *, n_layers: int, n_heads: int
) -> dict[str, Tensor]:
    """The weights of a Hugging Face `GPT2LMHeadModel` (its `state_dict()`) under the course's
    (TransformerLens's) names and shapes, for a `GPT2` of `n_layers` blocks of `n_heads` heads.

    `unembed.W_U` is `lm_head.weight` transposed (its own tensor, as in TransformerLens) and
    `unembed.b_U` is zero. The tensors keep their dtype and device.

    Course: chapter 6, exercise 6.5, checked by checks.gpt2.check_weight_conversion.
    """
    needed = ("transformer.wte.weight", "lm_head.weight", f"transformer.h.{n_layers - 1}.ln_1.bias")
    what = f"the state dict of a GPT2LMHeadModel with n_layers={n_layers}"
    validate.has_keys("hf_state_dict", hf_state_dict, needed, what)
    hf = hf_state_dict
    lm_head = hf["lm_head.weight"]
    state = {
        "embed.W_E": hf["transformer.wte.weight"],
        "pos_embed.W_pos": hf["transformer.wpe.weight"],
        "ln_final.w": hf["transformer.ln_f.weight"],
        "ln_final.b": hf["transformer.ln_f.bias"],
        "unembed.W_U": lm_head.T,
        "unembed.b_U": lm_head.new_zeros(lm_head.shape[0]),
    }
    for layer in range(n_layers):
        src, dst = f"transformer.h.{layer}.", f"blocks.{layer}."
        # c_attn holds [Q | K | V] along its output dimension, each (d_model, n_heads * d_head).
        weights = hf[src + "attn.c_attn.weight"].chunk(3, dim=1)
        biases = hf[src + "attn.c_attn.bias"].chunk(3, dim=0)
        for name, weight, bias in zip("QKV", weights, biases):
            state[f"{dst}attn.W_{name}"] = einops.rearrange(
                weight, "d_model (head d_head) -> head d_model d_head", head=n_heads
            )
            state[f"{dst}attn.b_{name}"] = einops.rearrange(
                bias, "(head d_head) -> head d_head", head=n_heads
            )
        state[dst + "attn.W_O"] = einops.rearrange(
            hf[src + "attn.c_proj.weight"],
            "(head d_head) d_model -> head d_head d_model",
            head=n_heads,
        )
        state.update({dst + ours: hf[src + theirs] for ours, theirs in RENAMED.items()})
    return state
