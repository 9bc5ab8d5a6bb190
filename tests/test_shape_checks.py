"""The run-time shape checks the suite runs under (tests/shape_checks.py) are on, and work."""

from __future__ import annotations

import pytest
import shape_checks
import torch
from jaxtyping import Float, TypeCheckError
from torch import Tensor

from transformer_course import attention, gpt2


def test_the_package_is_checked_everywhere_its_functions_are_named():
    assert getattr(attention.attention_scores, "__shape_checked__", False)
    assert getattr(attention.MultiHeadAttention.forward, "__shape_checked__", False)
    assert gpt2.GPT2.forward.__shape_checked__


def transposed(x: Float[Tensor, "rows cols"]) -> Float[Tensor, "rows cols"]:
    """Annotated wrongly: the result is (cols, rows)."""
    if x.ndim != 2:
        raise ValueError("x: expected a matrix")
    return x.T


def test_a_wrong_shape_annotation_fails_and_a_refused_input_keeps_its_own_error():
    checked = shape_checks._wrap(transposed, shape_checks._array_hints(transposed))
    checked(torch.zeros(3, 3))  # square: rows and cols agree either way
    with pytest.raises(TypeCheckError, match="returned Tensor \\(3, 2\\)"):
        checked(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="expected a matrix"):
        checked(torch.zeros(2))
