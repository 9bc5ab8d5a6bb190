"""LoRA (`lora`) against Hugging Face PEFT 0.21 (`LoraConfig` + `get_peft_model`) on a model of
`nn.Linear`s with the same A and B copied in, and the update of the course's einsum weights
against its formula written here per layout. Tolerances, float64 throughout:

- Forward, the gradients of A and B, and the merged model against PEFT's `merge_and_unload`:
  1e-12 (the same products in another order).
- The einsum weights' update against the index formula: 1e-12; a merged decoder's logits
  against the parametrized one's: 1e-10.
- Exact: the model unchanged before training (B is zero), the count of trainable parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from transformer_course.llama import Llama, LlamaConfig
from transformer_course.lora import LORA_LAYOUTS, LoRALinear, LoRAUpdate, inject_lora, merge_lora

RANK, ALPHA = 3, 12.0


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 5, bias=False)

    def forward(self, x):
        return self.down(torch.tanh(self.up(x)))


def models():
    torch.manual_seed(0)
    base = TwoLayers().double()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["up", "down"], lora_dropout=0.0)
    theirs = get_peft_model(copy.deepcopy(base), config)
    ours = inject_lora(copy.deepcopy(base), RANK, ALPHA, targets=("up", "down"))
    for name in ("up", "down"):
        layer, peft_layer = getattr(ours, name), getattr(theirs.base_model.model, name)
        assert isinstance(layer, LoRALinear) and layer.scaling == ALPHA / RANK
        assert torch.equal(layer.lora_B, torch.zeros_like(layer.lora_B))  # both start at zero
        with torch.no_grad():
            layer.lora_B.normal_()  # as after some training
            peft_layer.lora_A["default"].weight.copy_(layer.lora_A)
            peft_layer.lora_B["default"].weight.copy_(layer.lora_B)
    return base, ours, theirs


def test_lora_linear_matches_peft():
    base, ours, theirs = models()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    out, expected = ours(x), theirs(x)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    assert not torch.allclose(out, base(x))
    out.square().sum().backward(), expected.square().sum().backward()
    for name in ("up", "down"):
        layer, peft_layer = getattr(ours, name), getattr(theirs.base_model.model, name)
        for mine, key in ((layer.lora_A, "lora_A"), (layer.lora_B, "lora_B")):
            reference = getattr(peft_layer, key)["default"].weight.grad
            torch.testing.assert_close(mine.grad, reference, atol=1e-12, rtol=0)
        assert layer.base.weight.grad is None  # frozen
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}" for n in ("up", "down") for ab in "AB"}
    merged, peft_merged = merge_lora(ours), theirs.merge_and_unload()
    assert type(merged.up) is nn.Linear and type(merged.down) is nn.Linear
    torch.testing.assert_close(merged(x), peft_merged(x), atol=1e-12, rtol=0)
    torch.testing.assert_close(merged.up.weight, peft_merged.up.weight, atol=1e-12, rtol=0)


def index_formula(name, A, B, shape, scaling):
    """The update of weight `name`, from nn.Linear's `delta W = scaling B A` (out, in)."""
    if name in ("W_Q", "W_K", "W_V"):  # in: d_model; out: (head, d_head)
        B = B.view(shape[0], shape[2], -1)
        return scaling * torch.einsum("hor,ri->hio", B, A)
    if name == "W_O":  # in: (head, d_head); out: d_model
        return scaling * torch.einsum("or,rhi->hio", B, A.view(-1, shape[0], shape[1]))
    return scaling * torch.einsum("or,ri->io", B, A)


@pytest.mark.parametrize("name", LORA_LAYOUTS)
def test_einsum_weight_update_matches_its_formula(name):
    shape = (4, 8, 5) if LORA_LAYOUTS[name][0].startswith("head") else (8, 7)
    update = LoRAUpdate(shape, LORA_LAYOUTS[name], RANK, ALPHA).double()
    with torch.no_grad():
        update.lora_B.normal_()
    weight = torch.randn(shape, dtype=torch.float64)
    expected = weight + index_formula(name, update.lora_A, update.lora_B, shape, ALPHA / RANK)
    torch.testing.assert_close(update(weight), expected, atol=1e-12, rtol=0)


def test_inject_and_merge_a_decoder():
    torch.manual_seed(1)
    cfg = LlamaConfig(16, 2, 4, 2, 6, 24, 37, 16)
    model = Llama(cfg).double()
    tokens = torch.randint(37, (2, 9))
    before = model(tokens)
    inject_lora(model, RANK, ALPHA)
    torch.testing.assert_close(model(tokens), before, atol=0, rtol=0)  # B = 0: unchanged
    trainable = [p for p in model.parameters() if p.requires_grad]
    d = dict(q=16 + 4 * 6, k=16 + 2 * 6, v=16 + 2 * 6, o=4 * 6 + 16, mlp=(16 + 24) * 3)
    assert sum(p.numel() for p in trainable) == 2 * RANK * sum(d.values())
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.abs().sum() == 0:
                p.normal_()
    tuned = model(tokens)
    assert not torch.allclose(tuned, before)
    twin = copy.deepcopy(model)  # a frozen reference copy, as DPO keeps
    merge_lora(model)
    assert not any("lora" in name for name in model.state_dict())
    assert all(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(model(tokens), tuned, atol=1e-10, rtol=0)
    torch.testing.assert_close(twin(tokens), tuned, atol=0, rtol=0)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: LoRALinear(nn.Linear(3, 4), 0, 1.0), "rank: expected a positive int"),
        (lambda: LoRALinear(nn.Linear(3, 4), 2, 0.0), "alpha: expected"),
        (lambda: LoRALinear(nn.Conv1d(3, 4, 1), 2, 1.0), "base: expected an nn.Linear"),
        (lambda: inject_lora(TwoLayers(), 2, 1.0, targets=("W_Q",)), "targets: expected names"),
    ],
)
def test_bad_input_is_refused(call, words):
    with pytest.raises((ValueError, TypeError), match=words):
        call()
