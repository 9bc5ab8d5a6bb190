"""AdamW, gradient clipping and cross-entropy by hand against PyTorch's own.

Tolerances:
- AdamW against `torch.optim.AdamW`, every parameter after each of 60 steps: 1e-12 in float64
  (the two write the bias correction differently; measured ~3e-16); 1e-5 in float32 (measured
  ~2e-7).
- `clip_grad_norm` against `torch.nn.utils.clip_grad_norm_`: returned norm and clipped gradients
  within 1e-12 in float64.
- `cross_entropy` against `F.cross_entropy`: loss and gradient within 1e-12 in float64; at
  logits of +-1e4 in float32, relative 1e-6; on bfloat16 logits, within 1e-6 of
  `F.cross_entropy` on the same logits in float32 (both compute in float32), and within 2% of
  `F.cross_entropy` in bfloat16 itself (bf16 keeps 8 bits of mantissa).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_course.optim import AdamW, clip_grad_norm, cross_entropy
from transformer_course.training import cosine_lr


def small_model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3)
    ).to(dtype)


def param_groups(model: nn.Module) -> list[dict]:
    """Matrices with weight decay, biases without and at their own learning rate."""
    matrices = [p for p in model.parameters() if p.ndim == 2]
    biases = [p for p in model.parameters() if p.ndim == 1]
    return [
        {"params": matrices, "weight_decay": 0.1},
        {"params": biases, "weight_decay": 0.0, "lr": 3e-3},
    ]


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, dtype) -> list:
    """`steps` steps of regression on seeded batches, the learning rate of the first group
    following `training.cosine_lr`; the parameters after each step."""
    history = []
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(16, 6, generator=generator, dtype=dtype)
        y = torch.randn(16, 3, generator=generator, dtype=dtype)
        optimizer.param_groups[0]["lr"] = cosine_lr(
            step, lr=3e-2, warmup_steps=5, max_steps=60, min_lr=3e-3
        )
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        history.append([p.detach().clone() for p in model.parameters()])
    return history


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_adamw_equals_torch_over_60_steps(dtype, atol):
    ours, theirs = small_model(dtype), small_model(dtype)
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ours_history = train(ours, AdamW(param_groups(ours), **kwargs), range(60), dtype)
    theirs_history = train(
        theirs, torch.optim.AdamW(param_groups(theirs), **kwargs, foreach=False), range(60), dtype
    )
    for step, (mine, reference) in enumerate(zip(ours_history, theirs_history)):
        worst = max((a - b).abs().max().item() for a, b in zip(mine, reference))
        assert worst <= atol, f"step {step}: {worst}"
    assert (ours_history[-1][0] - small_model(dtype)[0].weight).abs().max() > 0.1  # it moved


def test_adamw_defaults_are_torchs():
    params = [nn.Parameter(torch.zeros(2))]
    ours, theirs = AdamW(params).defaults, torch.optim.AdamW(params).defaults
    assert {key: ours[key] for key in ours} == {key: theirs[key] for key in ours}


def test_adamw_decays_weights_without_gradient_scaling():
    """With a zero gradient Adam's step is 0, so only the decoupled decay moves the weights:
    p <- p (1 - lr * weight_decay), whatever the gradients' scale."""
    param = nn.Parameter(torch.ones(3, dtype=torch.float64))
    optimizer = AdamW([param], lr=0.1, weight_decay=0.5)
    param.grad = torch.zeros(3, dtype=torch.float64)
    optimizer.step()
    assert torch.allclose(param, torch.full((3,), 0.95, dtype=torch.float64), atol=1e-15)


def test_adamw_state_dict_resumes_exactly():
    model = small_model(torch.float64)
    straight = train(model, AdamW(param_groups(model)), range(20), torch.float64)[-1]
    model = small_model(torch.float64)
    optimizer = AdamW(param_groups(model))
    train(model, optimizer, range(10), torch.float64)
    state = optimizer.state_dict()
    resumed_optimizer = AdamW(param_groups(model))
    resumed_optimizer.load_state_dict(state)
    resumed = train(model, resumed_optimizer, range(10, 20), torch.float64)[-1]
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(lr=-1.0), "lr"),
        (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
        (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
        (dict(betas=(0.9,)), "betas"),
        (dict(eps=-1e-8), "eps"),
        (dict(eps=0.0), "eps: expected a finite number > 0"),
        (dict(weight_decay=-0.1), "weight_decay"),
    ],
)
def test_adamw_rejects_bad_hyperparameters(kwargs, word):
    with pytest.raises(ValueError, match=word):
        AdamW([nn.Parameter(torch.zeros(2))], **kwargs)


def test_adamw_checks_each_groups_settings_and_parameters_when_it_steps():
    """A group's own settings, or ones a schedule changed, are checked before any update; so are
    parameters it cannot update without NaN: float16 (eps 1e-8 rounds to 0 there, and a zero
    gradient gives 0/0), complex ones and sparse gradients."""
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))]
    optimizer = AdamW([{"params": params[:1]}, {"params": params[1:], "eps": -1.0}])
    for param in params:
        param.grad = torch.ones(2)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['eps'\]: expected .* > 0"):
        optimizer.step()
    assert torch.equal(params[0].detach(), torch.ones(2))  # refused before any update
    optimizer.param_groups[1]["eps"], optimizer.param_groups[0]["lr"] = 1e-8, -0.1
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]"):
        optimizer.step()
    for param, word in [
        (nn.Parameter(torch.zeros(3, dtype=torch.float16)), "float16"),
        (nn.Parameter(torch.zeros(3, dtype=torch.complex64)), "complex64"),
    ]:
        param.grad = torch.zeros_like(param)
        with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\].*{word}"):
            AdamW([param]).step()
    embedding = nn.Embedding(5, 3, sparse=True)
    embedding(torch.tensor([1])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient"):
        AdamW(embedding.parameters()).step()


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e3])
def test_clip_grad_norm_equals_torch(max_norm):
    ours, theirs = small_model(torch.float64), small_model(torch.float64)
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for model in (ours, theirs):
        model(x).pow(2).sum().backward()
        model[2].bias.grad = None  # a parameter without a gradient is skipped
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    actual = clip_grad_norm(ours.parameters(), max_norm)
    assert isinstance(actual, torch.Tensor) and actual.shape == ()
    assert abs(actual.item() - expected.item()) <= 1e-12
    for mine, reference in zip(ours.parameters(), theirs.parameters()):
        if reference.grad is None:
            assert mine.grad is None
        else:
            assert (mine.grad - reference.grad).abs().max().item() <= 1e-12
    total = torch.cat([p.grad.flatten() for p in ours.parameters() if p.grad is not None]).norm()
    assert total.item() <= max_norm * (1 + 1e-9)


def test_clip_grad_norm_of_one_tensor_and_of_none():
    param = nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm(param, 1.0).item() == pytest.approx(5.0)
    assert param.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm([nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(param, -1.0)


def test_clip_grad_norm_measures_at_inf_and_leaves_non_finite_gradients_alone():
    """max_norm=inf measures without clipping, as in PyTorch. A non-finite norm is returned with
    the gradients untouched (PyTorch would scale [inf, 1] to [nan, 0]), and a named parameter
    list is refused naming its first entry."""
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([3.0, 4.0])
    assert clip_grad_norm([param], float("inf")).item() == pytest.approx(5.0)
    assert torch.equal(param.grad, torch.tensor([3.0, 4.0]))
    param.grad = torch.tensor([float("inf"), 1.0])
    assert clip_grad_norm([param], 1.0).item() == float("inf")
    assert torch.equal(param.grad, torch.tensor([float("inf"), 1.0]))
    with pytest.raises(TypeError, match=r"parameters\[0\]: expected a torch.Tensor, got tuple"):
        clip_grad_norm(nn.Linear(2, 2).named_parameters(), 1.0)


@pytest.mark.parametrize("shape", [(5, 11), (2, 7, 11), (11,)])
def test_cross_entropy_equals_torch_with_its_gradient(shape):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(shape, dtype=torch.float64, generator=generator) * 3
    targets = torch.randint(0, 11, shape[:-1], generator=generator)
    ours = logits.clone().requires_grad_()
    theirs = logits.clone().requires_grad_()
    loss = cross_entropy(ours, targets)
    expected = F.cross_entropy(theirs.reshape(-1, 11), targets.reshape(-1))
    loss.backward(), expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12
    assert (ours.grad - theirs.grad).abs().max().item() <= 1e-12


def test_cross_entropy_is_stable_at_huge_logits():
    generator = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (6, 50), generator=generator) * 2 - 1
    logits = signs * 1e4 + torch.randn(6, 50, generator=generator)
    targets = torch.randint(0, 50, (6,), generator=generator)
    naive = -(logits.exp() / logits.exp().sum(-1, keepdim=True)).log()
    assert not naive.isfinite().all()  # exp(1e4) overflows
    loss, expected = cross_entropy(logits, targets), F.cross_entropy(logits, targets)
    assert loss.isfinite() and loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_cross_entropy_on_bfloat16_computes_in_float32():
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(4, 9, 100, generator=generator) * 5).bfloat16()
    targets = torch.randint(0, 100, (4, 9), generator=generator)
    loss = cross_entropy(logits, targets)
    assert loss.dtype == torch.float32
    in_float32 = F.cross_entropy(logits.float().reshape(-1, 100), targets.reshape(-1))
    assert abs(loss.item() - in_float32.item()) <= 1e-6
    in_bf16 = F.cross_entropy(logits.reshape(-1, 100), targets.reshape(-1))
    assert loss.item() == pytest.approx(in_bf16.float().item(), rel=0.02)


@pytest.mark.parametrize(
    "logits, targets, word",
    [
        (torch.randn(3, 5), torch.zeros(4, dtype=torch.long), "targets"),
        (torch.randn(3, 5), torch.zeros(3), "targets"),
        (torch.randn(3, 5), torch.tensor([0, 5, 1]), "d_vocab=5"),
        (torch.randn(3, 5), torch.tensor([0, -1, 1]), "targets"),
        (torch.zeros(3, 5, dtype=torch.long), torch.zeros(3, dtype=torch.long), "logits"),
        (torch.zeros(0, 5), torch.zeros(0, dtype=torch.long), "non-empty"),
    ],
)
def test_cross_entropy_rejects_bad_inputs(logits, targets, word):
    with pytest.raises(ValueError, match=word):
        cross_entropy(logits, targets)
