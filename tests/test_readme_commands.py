"""Every command the README shows runs, and so does every command that the benchmarks' and
`scripts/train_gpt2.py`'s docstrings show: each as a subprocess from the repository root, at a
tiny size where the real one takes minutes, and each prints its result line. `python ...` runs
through `tests/forkserver.py`, as `python` would run it but without importing torch and
TransformerLens again.

`COMMANDS` maps each command, as written, to how it is checked:

- `Run`: this file runs it with options that make it tiny (options a user can pass too, in the
  script's `--help`; none is a test-only switch) and checks that it exits 0 and prints the
  lines its result is read from. A command that needs CUDA (`torch.compile` builds C++ kernels
  for minutes on a CPU, GPT-2 small takes minutes a step) says why, and is skipped with that
  reason on a machine without CUDA.
- `Elsewhere`: a command this file does not run, because running it is the suite itself, or
  rewrites stored files, or another test runs it; `by` names that test (or file), which must
  exist.

`test_every_command_shown_is_known` reads README.md's code blocks and code spans and the
scripts' docstrings for commands (`python ...`, `bash ...`, `torchrun ...`, `jupyter-book ...`,
or a script under `scripts/` or `benchmarks/` with arguments; environment variables before a
command stay part of it), and fails on a command `COMMANDS` does not know, so a new command
comes with its tiny run, and on an entry no longer shown.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from forkserver import PYTHON

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The scripts whose docstrings' commands are checked too, and which must each have a run.
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py")) + [ROOT / "scripts" / "train_gpt2.py"]
CUDA = torch.cuda.is_available()
PROGRAMS = ("python", "python3", "bash", "torchrun", "jupyter-book")


@dataclass(frozen=True)
class Run:
    """Run `argv` (a leading "python" is this interpreter) and search its output for `expect`."""

    argv: tuple[str, ...]
    expect: tuple[str, ...]  # regular expressions (multiline), each must match
    cuda: str | None = None  # why it needs CUDA; None: it runs anywhere


@dataclass(frozen=True)
class Elsewhere:
    """Not run here: `why`, and `by` (a path from the repository root) does it."""

    why: str
    by: str


def run(command: str, *expect: str, cuda: str | None = None) -> Run:
    return Run(tuple(shlex.split(command)), expect, cuda)


# A tiny GPT-2 on Tiny Shakespeare's characters, after tests/test_train_gpt2.py's TINY.
TINY_GPT2 = (
    "--n-layers 1 --n-heads 2 --d-model 16 --block-size 8 --batch-size 4 --max-steps 2 "
    "--warmup-steps 1 --eval-every 1 --eval-batches 1 --sample-tokens 8"
)
BEST = r"^best: step \d+: val_loss \d+\.\d+$"
SAMPLED = r"^sample from the best model \(step \d+\):$"
COMPILE_ON_CPU = (
    "torch.compile builds C++ kernels on a CPU: minutes even for 2 steps of a tiny model"
)
GPT2_SMALL = "GPT-2 small (124M parameters, 16 x 1024 tokens a step) takes minutes a step on a CPU"
FULL_TRANSLATION = (
    "the full profile steps a 6-layer, 512-wide encoder-decoder on 512 pairs at a time: too "
    "slow on a CPU, even for one step"
)
RATIO_JSON = r'^ "ratio_ours_over_hf": \d+\.\d+$'
MFU = r'^  "mfu": \d+\.\d+'
STEPS_PER_S = r"^batch +8 eager: .* \d+\.\d+ steps/s"
QUICK_BLEU = r"^test BLEU \(beam {beam}, first 2 of \d+ sentences\): \d+\.\d with all references"
WHOLE_SUITE = "the suite itself, which includes this file; CI runs it (`bash .ci/run`)"

COMMANDS: dict[str, Run | Elsewhere] = {
    # README, "Quick start"
    "TRANSFORMER_COURSE_DATA=$PWD/../shared/data HF_HUB_OFFLINE=1 jupyter-book build . "
    "--warningiserror --nitpick --keep-going": Elsewhere(
        "the suite builds the book with these options (conftest.py's `book_html` fixture)",
        "tests/test_book_build.py",
    ),
    "TRANSFORMER_COURSE_DATA=$PWD/../shared/data HF_HUB_OFFLINE=1 python -m pytest -n auto": (
        Elsewhere(WHOLE_SUITE, ".ci/run")
    ),
    "python scripts/notebooks.py --execute": Elsewhere(
        "rewrites every stored notebook; the suite checks none is stale and nbval runs them",
        "tests/test_workbooks.py",
    ),
    "bash .ci/run": Elsewhere(
        "CI itself: a fresh virtual environment, the install, ruff and the whole suite", ".ci/run"
    ),
    # README, "Results you can reproduce", CPU
    "python benchmarks/tokenization.py": run(
        "python benchmarks/tokenization.py --max-chars 5000 --vocab-size 300 --repeats 1",
        r"^  course +encode .* = +\d+\.\d+x tiktoken's time",
        r"^train +ours .* ours/HF +\d+\.\dx",
        r"^encode +ours .* ours/HF +\d+\.\d+",
        r"^bytes per token +ours \d\.\d+ +HF \d\.\d+$",
    ),
    "python benchmarks/attention.py": run(
        "python benchmarks/attention.py --shape 2 16 32 4 --repeats 1",
        r"^  einsum / sdpa_math = \d+\.\d+",
        r"^  fast / sdpa += \d+\.\d+",
        r"^  peak memory sdpa +\d+ MiB$",
    ),
    "python benchmarks/flash_attention.py": run(
        "python benchmarks/flash_attention.py --device cuda --batch 1 --heads 2 --context 512 "
        "--repeats 1",
        r"^triton +\d+\.\d+ +\d+\.\d+ +\d+$",
        r"^triton / sdpa_flash: forward \d+\.\d+, forward\+backward \d+\.\d+$",
        cuda="Triton compiles its kernels for a GPU (the CPU tests run them in its interpreter)",
    ),
    "python benchmarks/flash_attention.py --device cpu": run(
        "python benchmarks/flash_attention.py --device cpu --heads 2 --context 256 --repeats 1",
        r"^saved for the backward: plain / flash = \d+\.\dx$",
        r"^time: flash / plain = \d+\.\d+x$",
    ),
    "python -m transformer_course.translation --profile quick": run(
        "python -m transformer_course.translation --profile quick --max-steps 1 --max-words 3 "
        "--test-sentences 2",
        r"^step +1 \| loss \d+\.\d+ .* valid_loss \d+\.\d+",
        QUICK_BLEU.format(beam=1),
        QUICK_BLEU.format(beam=4),
    ),
    "python scripts/train_gpt2.py --profile baby": run(
        f"python scripts/train_gpt2.py --profile baby {TINY_GPT2} --device cpu", BEST, SAMPLED
    ),
    "python benchmarks/gpt2.py": run("python benchmarks/gpt2.py --steps 1 --warmup 0", RATIO_JSON),
    "python benchmarks/grpo.py": run(
        "python benchmarks/grpo.py --d-model 32 --rollouts 4 --group-size 2 --new-tokens 4 "
        "--rounds 1",
        r"^rollout tokens/s with the KV cache [\d,]+, without [\d,]+: \d+\.\dx$",
        r"^GRPO step: sample \d+%, score \d+%, update \d+% of \d+\.\d+ s$",
    ),
    # README, "Results you can reproduce", one H100
    "COURSE_PROFILE=full python -m pytest --nbval-lax --durations=0 book exercises solutions": (
        Elsewhere(
            "every notebook runs in the suite (nbval, quick profile); the GPU workflow runs "
            "this with the full profile",
            ".github/workflows/gpu.yml",
        )
    ),
    "python -m pytest tests/test_cuda.py -n 4": Elsewhere(
        "part of the suite: its CPU cases run everywhere, its CUDA cases in the GPU workflow",
        "tests/test_cuda.py",
    ),
    "python -m transformer_course.translation --profile full": run(
        "python -m transformer_course.translation --profile full --max-steps 1 --max-words 3 "
        "--test-sentences 2",
        QUICK_BLEU.format(beam=4),
        cuda=FULL_TRANSLATION,
    ),
    "python benchmarks/translation.py --batch-sizes 256 1024": run(
        "python benchmarks/translation.py --profile quick --max-words 3 --batch-sizes 8 "
        "--warmup 1 --steps 1 --profile-steps 1",
        STEPS_PER_S,
    ),
    "python scripts/train_gpt2.py --profile full --compile": run(
        "python scripts/train_gpt2.py --profile full --compile --max-steps 2 --eval-every 2 "
        "--eval-batches 2 --sample-tokens 8",
        BEST,
        SAMPLED,
        cuda=COMPILE_ON_CPU,
    ),
    "python benchmarks/gpt2.py --size small --compile": run(
        "python benchmarks/gpt2.py --size small --compile --steps 1 --warmup 1",
        RATIO_JSON,
        MFU,
        cuda=GPT2_SMALL,
    ),
    # README, "Continuous integration"
    "scripts/gpu_check.sh STAGE...": run(
        "bash scripts/gpu_check.sh --dry-run first second translate",
        # the H100 table's measurements, as the table shows them, each with its time limit
        r"^::: char \(<= \d+ s\): python3 scripts/train_gpt2.py --profile full --compile$",
        r"^::: step \(<= \d+ s\): python3 benchmarks/gpt2.py --size small --compile "
        r"--profile-steps 2$",
        r"^::: page05 \(<= 300 s\): .* book/05_translation.ipynb$",
        r"^::: page06 \(<= 300 s\): .* book/06_gpt2.ipynb$",
        r"^::: cuda \(<= \d+ s\): python3 -m pytest .*tests/test_cuda.py -n 4\b",
        r"^::: notebooks \(<= \d+ s\): env OMP_NUM_THREADS=2 xargs .* -P 6 .* "
        r"python3 -m pytest .*--nbval-lax .*-p no:xdist$",
        r"^    book/07_llama.ipynb$",  # the notebooks, the longest first
        r"^    solutions/04_layernorm.ipynb$",
        r"^::: translate \(<= \d+ s\): python3 -m transformer_course.translation --profile full$",
        r"^::: t-bench \(<= \d+ s\): python3 benchmarks/translation.py --batch-sizes 256 1024 "
        r"--compile$",
    ),
    # README, "For maintainers"
    "python scripts/notebooks.py --execute NN_topic": Elsewhere(
        "rewrites one chapter's stored notebooks; the suite checks none is stale",
        "tests/test_workbooks.py",
    ),
    "python scripts/components.py": Elsewhere(
        "rewrites book/components.md; the suite checks it is current", "tests/test_components.py"
    ),
    # The scripts' docstrings
    "python benchmarks/layernorm.py": run(
        "python benchmarks/layernorm.py --shape 2 16 32 --repeats 1 --iters 1",
        r"^layer +\(2, 16, 32\) +\d+\.\d+ +\d+\.\d+ +\d+\.\d\d$",
        r"^rms +\(2, 16, 32\) +\d+\.\d+ +\d+\.\d+ +\d+\.\d\d$",
    ),
    "python benchmarks/gpt2.py --size small": run(
        "python benchmarks/gpt2.py --size small --steps 1 --warmup 0", RATIO_JSON, cuda=GPT2_SMALL
    ),
    "python benchmarks/gpt2.py --size small --compile --peak-tflops 989": run(
        "python benchmarks/gpt2.py --size small --compile --peak-tflops 989 --steps 1 --warmup 1",
        RATIO_JSON,
        MFU,
        cuda=GPT2_SMALL,
    ),
    "python benchmarks/translation.py": Elsewhere(
        "the run of `--batch-sizes 256 1024` above, which only adds a batch size",
        "benchmarks/translation.py",
    ),
    "python benchmarks/translation.py --batch-sizes 256 1024 --compile": run(
        "python benchmarks/translation.py --profile quick --max-words 3 --batch-sizes 8 "
        "--warmup 1 --steps 1 --profile-steps 1 --compile",
        STEPS_PER_S,
        cuda=COMPILE_ON_CPU,
    ),
    # The quick profile's own setup: it reuses the tokenizer that the run above trained.
    "python benchmarks/translation.py curve --batch-size 512 --lr 1e-3 --warmup 800 "
    "--max-steps 3000": run(
        "python benchmarks/translation.py --profile quick --max-words 3 curve --max-steps 1 "
        "--eval-every 1 --valid-pairs 4",
        r"^train +\d+s \| valid BLEU \d+\.\d$",
    ),
    "python scripts/train_gpt2.py --profile full": Elsewhere(
        "the `--profile baby` run: a tiny run overrides what the profiles set, but dropout",
        "scripts/train_gpt2.py",
    ),
    "torchrun --standalone --nproc_per_node=2 scripts/train_gpt2.py --profile baby": Elsewhere(
        "runs it (`torch.distributed.run --standalone --nproc_per_node=2`), tiny, against one "
        "process",
        "tests/test_gpt2_ddp.py",
    ),
    **{
        f"torchrun --standalone --nproc_per_node=2 scripts/train_gpt2.py --parallel {kind}": (
            Elsewhere(
                "runs it (`torch.distributed.run --standalone --nproc_per_node=2`), tiny, "
                "against one process and the formula's bytes",
                "tests/test_gpt2_ddp.py",
            )
        )
        for kind in ("ddp", "fsdp")
    },
}


# Finding the commands -------------------------------------------------------------------------


def commands_in(spans: list[str]) -> set[str]:
    """The commands among code spans or lines: split at `&&`, whitespace collapsed, environment
    assignments kept, a trailing `# comment` and `[optional]` usage arguments dropped."""
    found = set()
    for span in spans:
        for part in span.split("&&"):
            part = re.sub(r"\s*\[[^\]]*\]", "", part.split(" #")[0])
            words = part.split()
            i = 0
            while i < len(words) and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[i]):
                i += 1
            if i == len(words):
                continue
            program = words[i]
            script = re.fullmatch(r"(scripts|benchmarks)/\S+\.(py|sh)", program)
            if program in PROGRAMS or (script and len(words) > i + 1):
                found.add(" ".join(words))
    return found


def code_spans(markdown: str) -> list[str]:
    """The lines of fenced code blocks (comments aside), then every inline code span."""
    spans = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.M | re.S):
        spans += [line for line in block.splitlines() if not line.lstrip().startswith("#")]
    prose = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    return spans + re.findall(r"`([^`]+)`", prose)


def docstring_lines(path: Path) -> list[str]:
    """The module docstring's lines (with a `Usage:` prefix dropped) and its code spans."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    lines = [re.sub(r"^\s*Usage:\s*", "", line) for line in doc.splitlines()]
    return lines + re.findall(r"`([^`]+)`", doc)


def shown_commands() -> set[str]:
    shown = commands_in(code_spans(README.read_text(encoding="utf-8")))
    for script in SCRIPTS:
        shown |= commands_in(docstring_lines(script))
    return shown


def test_every_command_shown_is_known():
    shown = shown_commands()
    unknown, gone = sorted(shown - COMMANDS.keys()), sorted(COMMANDS.keys() - shown)
    assert not unknown, (
        f"commands shown in README.md or a script's docstring that {Path(__file__).name} does "
        f"not run; add each to COMMANDS with a tiny run: {unknown}"
    )
    assert not gone, f"COMMANDS entries no longer shown anywhere; remove them: {gone}"


def test_the_finder_finds_commands_in_blocks_spans_and_usage_lines():
    markdown = (
        "```bash\n# a comment `python no.py`\npip install x && A=1 B=$PWD/c python -m m --f\n```\n"
        "Run `python\nscripts/x.py --a` or `scripts/y.sh STAGE...`; `scripts/z.py` is a file,\n"
        "`ruff check .` not ours, `bash .ci/run` is.\n"
    )
    assert commands_in(code_spans(markdown)) == {
        "A=1 B=$PWD/c python -m m --f",
        "python scripts/x.py --a",
        "scripts/y.sh STAGE...",
        "bash .ci/run",
    }
    usage = ["python b.py [--n 5] [--x]   # what it does", "    python b.py --size small  # GPU"]
    assert commands_in(usage) == {"python b.py", "python b.py --size small"}


def test_every_script_has_a_run_and_every_elsewhere_names_a_file():
    argvs = [entry.argv for entry in COMMANDS.values() if isinstance(entry, Run)]
    for script in SCRIPTS:
        name = str(script.relative_to(ROOT))
        assert any(name in argv for argv in argvs), f"{name}: no tiny run in COMMANDS"
    for command, entry in COMMANDS.items():
        if isinstance(entry, Elsewhere):
            assert (ROOT / entry.by).exists(), f"{command}: {entry.by} does not exist"


# Running them -------------------------------------------------------------------------------


def tiny_runs():
    for command, entry in COMMANDS.items():
        if isinstance(entry, Run):
            needs = pytest.mark.skipif(not CUDA, reason=f"no CUDA device: {entry.cuda}")
            marks = [needs] if entry.cuda else []
            yield pytest.param(entry, id=command, marks=marks)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """One cache of trained translation models and tokenizers for every run in this file (the
    translation benchmark's two modes share the quick profile's tokenizer), never `runs/`."""
    return tmp_path_factory.mktemp("runs")


@pytest.mark.parametrize("entry", list(tiny_runs()))
def test_command_runs_tiny_and_prints_its_result(entry: Run, runs: Path):
    argv = list(entry.argv)
    if argv[0] == "python":
        argv[:1] = PYTHON
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "COURSE_PROFILE": "quick",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TRANSFORMER_COURSE_RUNS": str(runs),
    }
    result = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600 if entry.cuda else 300
    )
    output = result.stdout + result.stderr
    shown = f"{shlex.join(entry.argv)}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n"
    shown += result.stderr[-3000:]
    assert result.returncode == 0, f"exit {result.returncode}: {shown}"
    for pattern in entry.expect:
        assert re.search(pattern, output, flags=re.M), f"no line matches {pattern!r}: {shown}"


def test_the_gpu_check_runs_every_notebook_once():
    """`first` and `second` together run each notebook of book/, exercises/ and solutions/ once:
    book 05 and 06 as pages, every other one in `notebooks`, a new chapter's too."""
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "first", "second"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    listed = re.findall(r"^    (\S+\.ipynb)$", result.stdout, flags=re.M)
    pages = re.findall(r"^::: page0[56] .* (book/\S+\.ipynb)$", result.stdout, flags=re.M)
    every = sorted(
        str(path.relative_to(ROOT))
        for folder in ("book", "exercises", "solutions")
        for path in (ROOT / folder).glob("*.ipynb")
    )
    # the two pages' lines come in either order: the stage starts them side by side
    assert sorted(pages) == ["book/05_translation.ipynb", "book/06_gpt2.ipynb"], result.stdout
    assert sorted(listed + pages) == every, result.stdout
