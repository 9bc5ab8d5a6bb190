"""LoRA (Hu et al., 2021): fine-tune a frozen weight `W` through a low-rank update.

`W + (alpha / rank) * B A`, with `A` `(rank, d_in)` random and `B` `(d_out, rank)` zero, so the
model is unchanged before the first step and only `rank * (d_in + d_out)` numbers (and their
AdamW state) train per matrix. `LoRALinear` wraps an `nn.Linear`, with Hugging Face PEFT's
names and initialisation (`lora_A`, `lora_B`, `scaling = alpha / rank`).

The course's own decoder holds its matrices as einsum parameters (`W_Q` `(head, d_model,
d_head)`, `W_in` `(d_model, d_mlp)`, ...), not `nn.Linear`s. `inject_lora` gives each such
weight the same update, the `(d_in, d_out)` matrix `(B A)^T` laid out in the weight's shape, as
a PyTorch parametrization: the module still reads `self.W_Q`, now `W_Q + delta`. `merge_lora`
folds every update into plain weights for inference.
"""

from __future__ import annotations

import math

import einops
import torch
from jaxtyping import Float
from torch import Tensor, nn
from torch.nn.utils import parametrize

from transformer_course import validate

__all__ = ["LoRALinear", "LoRAUpdate", "LORA_LAYOUTS", "inject_lora", "merge_lora"]

# Each course weight as a matrix: its axes, the ones that are its input, the ones its output.
LORA_LAYOUTS = {
    "W_Q": ("head d_in d_out", "d_in", "head d_out"),
    "W_K": ("head d_in d_out", "d_in", "head d_out"),
    "W_V": ("head d_in d_out", "d_in", "head d_out"),
    "W_O": ("head d_in d_out", "head d_in", "d_out"),
    "W_gate": ("d_in d_out", "d_in", "d_out"),
    "W_in": ("d_in d_out", "d_in", "d_out"),
    "W_out": ("d_in d_out", "d_in", "d_out"),
}


def _low_rank(d_in: int, d_out: int, rank: int, alpha: float) -> tuple[nn.Parameter, ...]:
    """A `(rank, d_in)` as PEFT draws it (Kaiming-uniform) and B `(d_out, rank)` zero."""
    validate.positive_int("rank", rank)
    validate.number("alpha", alpha, low=0, low_open=True)
    A = nn.Parameter(torch.empty(rank, d_in))
    nn.init.kaiming_uniform_(A, a=math.sqrt(5))
    return A, nn.Parameter(torch.zeros(d_out, rank))


class LoRALinear(nn.Module):
    """`base(x) + (alpha / rank) * x A^T B^T`: a frozen `nn.Linear` plus a trainable low-rank
    update (`lora_A` `(rank, in_features)`, `lora_B` `(out_features, rank)`, zero at first).

    Course: chapter 9, exercise 9.7, checked by checks.assistant.check_lora_linear.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base: expected an nn.Linear, got {type(base).__name__}")
        self.lora_A, self.lora_B = _low_rank(base.in_features, base.out_features, rank, alpha)
        self.base = base.requires_grad_(False)
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.lora_A.data = self.lora_A.data.to(base.weight)
        self.lora_B.data = self.lora_B.data.to(base.weight)

    def forward(self, x: Float[Tensor, "*batch d_in"]) -> Float[Tensor, "*batch d_out"]:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain `nn.Linear` computing the same: weight `W + scaling * B A`.

        Course: chapter 9.
        """
        base = self.base
        merged = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
        merged = merged.to(base.weight)
        with torch.no_grad():
            merged.weight.copy_(base.weight + self.scaling * self.lora_B @ self.lora_A)
            if base.bias is not None:
                merged.bias.copy_(base.bias)
        return merged


class LoRAUpdate(nn.Module):
    """The parametrization `W -> W + (alpha / rank) * (B A)^T` of a weight of shape `shape`,
    the `(d_in, d_out)` matrix laid out as `layout` (an entry of `LORA_LAYOUTS`) says.

    Course: chapter 9.
    """

    def __init__(self, shape: tuple[int, ...], layout: tuple[str, str, str], rank: int, alpha):
        super().__init__()
        axes, inputs, outputs = layout
        if len(axes.split()) != len(shape):
            raise ValueError(f"shape: expected one size per axis of {axes!r}, got {tuple(shape)}")
        self.sizes = dict(zip(axes.split(), shape))
        self.pattern = f"({inputs}) ({outputs}) -> {axes}"
        d_in = math.prod(self.sizes[axis] for axis in inputs.split())
        d_out = math.prod(self.sizes[axis] for axis in outputs.split())
        self.scaling = alpha / rank
        self.lora_A, self.lora_B = _low_rank(d_in, d_out, rank, alpha)

    def forward(self, weight: Tensor) -> Tensor:
        matrix = (self.lora_B @ self.lora_A).T * self.scaling  # (d_in, d_out)
        return weight + einops.rearrange(matrix, self.pattern, **self.sizes).to(weight.dtype)


def inject_lora(
    model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...] = tuple(LORA_LAYOUTS)
) -> nn.Module:
    """Freeze every parameter of `model` and give each weight named in `targets` a LoRA update:
    the course's einsum weights (`LORA_LAYOUTS`) a `LoRAUpdate` parametrization, each
    `nn.Linear` child of that name a `LoRALinear`. Only the `lora_A`, `lora_B` then train.
    Returns `model`, changed in place.

    Course: chapter 9.
    """
    unknown = [name for name in targets if name not in LORA_LAYOUTS]
    model.requires_grad_(False)
    found = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in targets and isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
                found += 1
        for name in targets:
            weight = module._parameters.get(name)
            if weight is None or name in unknown:
                continue
            update = LoRAUpdate(weight.shape, LORA_LAYOUTS[name], rank, alpha).to(weight)
            parametrize.register_parametrization(module, name, update)
            found += 1
    if not found:
        raise ValueError(
            f"targets: expected names of weights in the model, found none of {targets}"
        )
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update of `model` into plain weights (a `LoRALinear` becomes its
    `merged()` `nn.Linear`), every parameter trainable again. Returns `model`, changed in place.

    Course: chapter 9.
    """
    for module in list(model.modules()):
        if parametrize.is_parametrized(module):
            # A deep copy shares the parametrized class, whose properties removal deletes: give
            # this module a class of its own first, so that a copy (DPO's reference) still works.
            cls = type(module)
            module.__class__ = type(cls.__name__, cls.__bases__, dict(vars(cls)))
            for name in list(module.parametrizations):
                parametrize.remove_parametrizations(module, name, leave_parametrized=True)
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())
    return model.requires_grad_(True)
