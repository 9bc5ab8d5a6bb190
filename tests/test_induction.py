"""Training data, logging and the phase-change finder of `transformer_course.induction`.

The logged losses and induction scores are recomputed independently: the losses with
`F.cross_entropy` on the final model, the scores by indexing TransformerLens's cached pattern of
the converted model one query at a time (max abs diff 1e-5, float32). The phase-change finder
runs on synthetic logs whose steps are known.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from transformer_course.attention_only import (
    AttentionOnlyConfig,
    AttentionOnlyTransformer,
    to_hooked_transformer,
)
from transformer_course.head_detectors import repeated_tokens
from transformer_course.induction import (
    InductionRun,
    copying_batch,
    phase_change_step,
    train_induction,
)

pytestmark = pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")


def test_copying_batch_rows_repeat_with_their_own_period():
    tokens = copying_batch(64, 33, 50, generator=torch.Generator().manual_seed(0))
    assert tokens.shape == (64, 33) and tokens.dtype == torch.long
    assert 0 <= tokens.min() and tokens.max() < 50
    periods = []
    for row in tokens:
        period = next(p for p in range(2, 17) if torch.equal(row[p:], row[:-p]))
        periods.append(period)
    assert min(periods) >= 33 // 4 and max(periods) <= 33 // 2
    assert len(set(periods)) > 3, "periods vary from row to row"


@pytest.mark.parametrize(
    "args, words",
    [((0, 8, 5), "batch"), ((2, 3, 5), "n_ctx"), ((2, 8, 0), "d_vocab")],
)
def test_copying_batch_refuses_bad_sizes(args, words):
    with pytest.raises(ValueError, match=words):
        copying_batch(*args)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = AttentionOnlyConfig(d_model=16, n_heads=2, d_vocab=20, n_ctx=16, normalization_type="LN")
    return AttentionOnlyTransformer(cfg)


def test_train_induction_logs_what_it_says():
    model = tiny_model()
    run = train_induction(model, steps=25, batch_size=8, eval_every=10, seed=3)
    assert run.steps == [0, 10, 20, 25]
    assert run.scores.shape == (4, 2, 2)
    assert abs(run.first_loss[0] - math.log(20)) < 0.1, "an untrained model is near uniform"
    # The last entry, recomputed from the final weights by hand.
    tokens = repeated_tokens(64, 8, 20, seed=4)
    with torch.no_grad():
        logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    assert abs(run.first_loss[-1] - loss[:, :7].mean().item()) < 1e-5
    assert abs(run.second_loss[-1] - loss[:, 8:].mean().item()) < 1e-5
    assert run.in_context_loss[-1] == run.second_loss[-1] - run.first_loss[-1]
    _, cache = to_hooked_transformer(model).run_with_cache(tokens)
    for layer in range(2):
        pattern = cache["pattern", layer]
        expected = torch.stack([pattern[:, :, q, q - 7] for q in range(8, 16)]).mean(dim=(0, 1))
        torch.testing.assert_close(run.scores[-1, layer], expected, atol=1e-5, rtol=0)


def test_train_induction_is_seeded():
    first = train_induction(tiny_model(), steps=5, batch_size=4, eval_every=5, seed=1)
    second = train_induction(tiny_model(), steps=5, batch_size=4, eval_every=5, seed=1)
    assert first.second_loss == second.second_loss
    assert torch.equal(first.scores, second.scores)


def test_warmup_and_weight_decay_scale_the_first_step():
    """A token absent from the first batch gets no gradient in its embedding row, so one AdamW
    step only decays that row: by lr * weight_decay, with lr at 1 / warmup_steps of its peak."""
    model = tiny_model()
    before = model.embed.W_E.detach().clone()
    train_induction(
        model, steps=1, batch_size=2, lr=1e-2, eval_every=1, seed=5, warmup_steps=4,
        weight_decay=0.5,
    )  # fmt: skip
    first_batch = copying_batch(2, 17, 20, generator=torch.Generator().manual_seed(5))
    absent = [t for t in range(20) if t not in first_batch[:, :-1]]
    assert absent, "the test needs a token the first batch does not hold"
    expected = before[absent] * (1 - 1e-2 / 4 * 0.5)
    torch.testing.assert_close(model.embed.W_E.detach()[absent], expected, atol=1e-7, rtol=0)


@pytest.mark.parametrize(
    "kwargs, words", [(dict(warmup_steps=-1), "warmup_steps"), (dict(weight_decay=-0.1), "weight")]
)
def test_train_induction_refuses_bad_settings(kwargs, words):
    with pytest.raises(ValueError, match=words):
        train_induction(tiny_model(), steps=1, **kwargs)


def synthetic_run(drop_at: int, rise_at: int, drop: float = 3.0, rise: float = 0.8):
    """A log every 10 steps: a sigmoid loss drop centred at `drop_at`, a score rise at `rise_at`."""
    steps = list(range(0, 1001, 10))
    t = torch.tensor(steps, dtype=torch.float64)
    loss = 3.5 - drop * torch.sigmoid((t - drop_at) / 15)
    score = 0.05 + rise * torch.sigmoid((t - rise_at) / 15)
    scores = [torch.tensor([[0.1, 0.1], [0.05, float(s)]]) for s in score]
    n = len(steps)
    return InductionRun(steps, [3.5] * n, loss.tolist(), scores)


def test_phase_change_step_finds_a_coinciding_drop_and_rise():
    assert phase_change_step(synthetic_run(300, 320), window=50) == 300
    assert phase_change_step(synthetic_run(600, 560), window=50) == 600


@pytest.mark.parametrize(
    "run",
    [synthetic_run(300, 700), synthetic_run(300, 300, drop=0.2), synthetic_run(300, 300, rise=0.1)],
)
def test_phase_change_step_is_none_without_one(run):
    assert phase_change_step(run, window=50) is None


def test_phase_change_step_refuses_a_negative_window():
    with pytest.raises(ValueError, match="window"):
        phase_change_step(synthetic_run(300, 300), window=-1)
