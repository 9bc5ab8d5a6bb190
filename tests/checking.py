"""What the checker tests share: a checker must reject a candidate with a message naming it."""

from __future__ import annotations

import pytest

from transformer_course.checks.harness import CheckFailure


def fails(check, candidate, *words: str) -> None:
    """`check(candidate)` raises `CheckFailure` whose message contains every one of `words`."""
    with pytest.raises(CheckFailure) as info:
        check(candidate)
    message = str(info.value)
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in: {message}"
