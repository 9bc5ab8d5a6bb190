"""Exercise checkers, one module per chapter's workbook, built from `checks.harness`: each prints
that the learner's code passes or raises `CheckFailure` with a hint naming the likely mistake.
Every chapter module's `check_*` functions are re-exported here, with `CheckFailure`."""

from transformer_course.checks import (
    assistant,
    attention,
    gpt2,
    interpretability,
    layernorm,
    llama,
    masking,
    tokenization,
    translation,
)
from transformer_course.checks.harness import CheckFailure

__all__ = ["CheckFailure"]
_CHAPTERS = (tokenization, attention, masking, layernorm, translation, gpt2, llama, assistant)
for _chapter in (*_CHAPTERS, interpretability):
    _checkers = {name: fn for name, fn in vars(_chapter).items() if name.startswith("check_")}
    globals().update(_checkers)
    __all__ += sorted(_checkers)
