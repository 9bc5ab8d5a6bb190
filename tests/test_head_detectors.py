"""Head detectors (chapter 10) against scores written here independently, as loops over queries,
on patterns made to be one kind of head, and on the repeated sequences' losses.

Tolerance: 1e-12 in float64 (sums of the same numbers in another order).
"""

from __future__ import annotations

import pytest
import torch

from transformer_course.head_detectors import (
    first_token_scores,
    induction_scores,
    per_token_loss,
    prev_token_scores,
    repeat_losses,
    repeated_tokens,
)


def random_pattern(batch=2, heads=3, pos=9, seed=0) -> torch.Tensor:
    """Causal softmax patterns in float64."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, heads, pos, pos, generator=generator, dtype=torch.float64)
    scores = scores.masked_fill(~torch.ones(pos, pos, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1)


def loop_score(pattern, key_of_query, queries) -> torch.Tensor:
    """Mean over batch and `queries` of pattern[b, h, q, key_of_query(q)], one loop per head."""
    batch, heads = pattern.shape[:2]
    return torch.tensor(
        [
            sum(pattern[b, h, q, key_of_query(q)] for b in range(batch) for q in queries)
            / (batch * len(queries))
            for h in range(heads)
        ],
        dtype=torch.float64,
    )


def test_scores_against_loops():
    pattern, seg_len = random_pattern(pos=9), 4  # [BOS, x(4), x(4)]
    expected_prev = loop_score(pattern, lambda q: q - 1, range(1, 9))
    expected_first = loop_score(pattern, lambda q: 0, range(1, 9))
    expected_induction = loop_score(pattern, lambda q: q - seg_len + 1, range(5, 9))
    torch.testing.assert_close(prev_token_scores(pattern), expected_prev, atol=1e-12, rtol=0)
    torch.testing.assert_close(first_token_scores(pattern), expected_first, atol=1e-12, rtol=0)
    torch.testing.assert_close(
        induction_scores(pattern, seg_len), expected_induction, atol=1e-12, rtol=0
    )


def test_ideal_heads_score_one_on_their_own_detector():
    pos, seg_len = 9, 4
    prev = torch.zeros(pos, pos)
    prev[0, 0], prev[torch.arange(1, pos), torch.arange(pos - 1)] = 1, 1
    first = torch.zeros(pos, pos)
    first[:, 0] = 1
    induction = first.clone()  # queries with no earlier occurrence rest on BOS
    for q in range(pos - seg_len, pos):
        induction[q] = 0
        induction[q, q - seg_len + 1] = 1
    pattern = torch.stack([prev, first, induction])[None]
    torch.testing.assert_close(
        prev_token_scores(pattern), torch.tensor([1.0, 1 / 8, 1 / 8])
    )  # query 1 rests on BOS
    torch.testing.assert_close(first_token_scores(pattern), torch.tensor([1 / 8, 1.0, 4 / 8]))
    torch.testing.assert_close(induction_scores(pattern, seg_len), torch.tensor([0.0, 0, 1]))


def test_induction_score_without_bos_reads_the_same_diagonal():
    pattern, seg_len = random_pattern(pos=8), 4  # [x(4), x(4)]
    expected = loop_score(pattern, lambda q: q - seg_len + 1, range(4, 8))
    torch.testing.assert_close(induction_scores(pattern, seg_len), expected, atol=1e-12, rtol=0)


def test_repeated_tokens():
    toks = repeated_tokens(3, 5, 11, bos=10, seed=2)
    assert toks.shape == (3, 11) and toks.dtype == torch.long
    assert (toks[:, 0] == 10).all() and (toks[:, 1:] != 10).all()
    assert torch.equal(toks[:, 1:6], toks[:, 6:])
    assert torch.equal(toks, repeated_tokens(3, 5, 11, bos=10, seed=2))
    assert not torch.equal(toks, repeated_tokens(3, 5, 11, bos=10, seed=3))
    plain = repeated_tokens(2, 4, 7)
    assert plain.shape == (2, 8) and torch.equal(plain[:, :4], plain[:, 4:])


def test_repeat_losses_split_against_a_direct_computation():
    toks = repeated_tokens(2, 4, 11, bos=10)
    logits = torch.randn(2, 9, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    loss = per_token_loss(logits, toks)
    expected = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), toks[:, 1:].reshape(-1), reduction="none"
    ).reshape(2, 8)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    first, second = repeat_losses(loss, 4)
    # tokens 2..4 (first repeat but its first) are predicted from positions 1..3; tokens 6..8
    torch.testing.assert_close(first, expected[:, 1:4])
    torch.testing.assert_close(second, expected[:, 5:8])


@pytest.mark.parametrize(
    "call, word",
    [
        (lambda: prev_token_scores(torch.ones(2, 3, 4)), "pattern"),
        (lambda: first_token_scores(torch.ones(1, 2, 3, 4)), "q_pos == k_pos"),
        (lambda: induction_scores(random_pattern(pos=9), 5), "seg_len"),
        (lambda: induction_scores(random_pattern(pos=9), 1), "seg_len"),
        (lambda: repeated_tokens(2, 3, 5, bos=5), "bos"),
        (
            lambda: per_token_loss(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long)),
            "tokens",
        ),
    ],
)
def test_bad_input_is_named(call, word):
    with pytest.raises(ValueError, match=word):
        call()
