"""Profiles, devices, seeding and evaluation mode: the few knobs every notebook and script shares.

`COURSE_PROFILE=quick|full` picks model and data sizes. The default is `full` on CUDA and
`quick` elsewhere, so CPU runs (and CI) stay fast while a GPU gives the real results.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import numpy as np
import torch

PROFILES = ("quick", "full")
T = TypeVar("T")


def get_device() -> torch.device:
    """The best available device: CUDA, then Apple's MPS, then the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def get_profile() -> str:
    """The active profile: `$COURSE_PROFILE`, else `full` on CUDA and `quick` elsewhere."""
    profile = os.environ.get("COURSE_PROFILE", "").strip().lower()
    if not profile:
        return "full" if get_device().type == "cuda" else "quick"
    if profile not in PROFILES:
        raise ValueError(f"COURSE_PROFILE must be one of {PROFILES}, got {profile!r}")
    return profile


def by_profile(*, quick: T, full: T) -> T:
    """Choose a setting by profile: `n_steps = by_profile(quick=200, full=5000)`."""
    return full if get_profile() == "full" else quick


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and PyTorch (all devices) so a rerun gives the same numbers."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Evaluation mode and no gradients inside the block; the model's own mode comes back after,
    even on an error: `with evaluating(model): loss = ...`."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield model
    finally:
        model.train(was_training)


def describe_run() -> str:
    """One line saying which profile and device this run uses, for the top of every notebook."""
    device = get_device()
    return f"profile={get_profile()} device={device.type} torch={torch.__version__}"


def upcast(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 if it is float16 or bfloat16, else unchanged: the dtype to accumulate in.

    Half precision loses too much in a long sum, and float16 overflows above 65504.

    Course: chapter 3.
    """
    return t.to(torch.promote_types(t.dtype, torch.float32))


def show_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    """Show `rows` under `header` as a real table in a notebook (Markdown, so a book page renders
    it as HTML: columns stay aligned at any width). Outside a notebook, print the Markdown.

    Course: chapter 1.
    """
    rows = [list(map(str, row)) for row in rows]
    for i, row in enumerate(rows):
        if len(row) != len(header):
            raise ValueError(
                f"rows[{i}]: expected {len(header)} cells (the header's), got {len(row)}"
            )
    escape = lambda cell: cell.replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(escape, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(escape, row)) + " |" for row in rows]
    markdown = "\n".join(lines)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
    except ImportError:  # plain Python: no notebook to show it in
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Markdown(markdown))
    else:
        print(markdown)
