"""pytest setup for the whole suite: unit tests, nbval on the pages and solutions, the built book.

- Nothing reaches a model or dataset hub (the notebook kernels inherit this environment too).
- Each book page is executed once per run: nbval executes it and compares outputs, and its
  fresh outputs go into the Jupyter Book execution cache, so the `book_html` fixture's build
  renders those outputs instead of executing every page a second time.
- Notebook kernels, and the Python commands the tests run, start in processes forked from one
  that has imported torch and TransformerLens (`tests/forkserver.py`, one for the run):
  importing them costs about 10 s a process on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parent / "tests"))  # the tests' helpers

ROOT = Path(__file__).resolve().parent
BOOK_DIR = ROOT / "book"
BUILD_DIR = ROOT / "_build"
EXECUTION_CACHE = BUILD_DIR / ".jupyter_cache"
BOOK_TESTS = {"test_book_build.py", "test_book_html.py"}  # tests that use the built book
# Book pages run on the other xdist worker, first in the solutions' queue, to share the load;
# each hands its fresh outputs to the book build through a file in HANDED_OFF_DIR.
HANDED_OFF = {"07_llama.ipynb"}
HANDED_OFF_DIR = BUILD_DIR / "handed_off"
FORKED_KERNEL = "transformer-course-forked"  # nbval's kernel when the fork server runs
_FORKSERVER = pytest.StashKey[tuple[subprocess.Popen, Path]]()  # the server and its folder

_code_cells: dict[Path, int] = {}  # book page -> number of code cells nbval collected
_executed: dict[Path, dict[int, list]] = {}  # book page -> code cell number -> fresh outputs


def _is_book_cell(item) -> bool:
    return Path(str(item.fspath)).parent == BOOK_DIR and hasattr(item, "cell_num")


def pytest_configure(config):
    """Under pytest-xdist (`-n N`), share the cores: each worker, and each notebook kernel it
    starts, gets cores / N threads. Small models gain little from a second thread, so two
    workers with one thread each finish the suite sooner than one worker with two. An
    `OMP_NUM_THREADS` set by whoever runs the suite wins: `OMP_NUM_THREADS=2 pytest -n 2` runs
    every kernel on two threads (the claims must hold at any thread count)."""
    if not hasattr(config, "workerinput"):  # the controller, before any worker runs a page
        shutil.rmtree(HANDED_OFF_DIR, ignore_errors=True)
    if _is_controller(config):  # it runs no test: it only starts the workers' fork server
        _start_forkserver(config)
        return
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores_each = str(max(1, (os.cpu_count() or 1) // int(workers)))
        threads = os.environ.get("OMP_NUM_THREADS") or cores_each
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[name] = threads
        if "torch" in sys.modules:  # already imported: the variables came too late for it
            sys.modules["torch"].set_num_threads(int(threads))
    # Every jaxtyping annotation in the package is checked at run time while the tests run (a
    # wrong shape, or a wrong shape annotation, fails the test): tests/shape_checks.py.
    import shape_checks

    shape_checks.install()
    _start_forkserver(config)
    socket = Path(os.environ.get("COURSE_FORKSERVER", "off"))  # "off": no folder, no kernel
    forked_kernel = socket.parent / "kernels" / FORKED_KERNEL
    forked = socket.is_absolute() and forked_kernel.exists()
    if forked and config.getoption("nbval_current_env", False):
        config.option.nbval_current_env = False  # the same interpreter, started forked
        config.option.nbval_kernel_name = FORKED_KERNEL


def _is_controller(config) -> bool:
    """Whether this is pytest-xdist's controller, which hands tests to the workers."""
    return config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput")


def _start_forkserver(config) -> None:
    """Start `tests/forkserver.py`, once for the whole run (pytest-xdist's workers inherit its
    variable), with a kernel spec that starts nbval's kernels through it. Only on Linux
    (macOS's system libraries are not safe to fork), not with `COURSE_FORKSERVER` set (to
    `off`, or to a server already running), and not beside a GPU (a process forked after CUDA's
    driver has started cannot use it)."""
    gpu = any(Path(device).exists() for device in ("/proc/driver/nvidia", "/dev/kfd"))
    if os.environ.get("COURSE_FORKSERVER") or sys.platform != "linux" or gpu:
        return
    import forkserver

    folder = Path(tempfile.mkdtemp(prefix="course-forkserver-"))
    path = folder / "socket"
    server = forkserver.start(str(path))
    if server is None:  # every process starts afresh
        shutil.rmtree(folder, ignore_errors=True)
        return
    config.stash[_FORKSERVER] = server, folder
    spec = folder / "kernels" / FORKED_KERNEL / "kernel.json"
    spec.parent.mkdir(parents=True)
    argv = [*forkserver.PYTHON, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "language": "python"}
    spec.write_text(json.dumps({**kernel, "display_name": FORKED_KERNEL}))
    os.environ["COURSE_FORKSERVER"] = str(path)
    jupyter_path = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(folder), jupyter_path]))


def pytest_unconfigure(config):
    server, folder = config.stash.get(_FORKSERVER, (None, None))
    if server is not None:
        server.terminate()
        server.wait(timeout=60)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n N`, hand out whole files, and keep together on one worker, in order:
    the book pages and the book build that reuses their outputs; the solutions workbooks, each
    of which loads the parts the earlier ones saved (`parts.keep`, `parts.load_parts`), after
    the book pages in HANDED_OFF (collected first, so run first)."""
    from xdist.scheduler import LoadScopeScheduling

    class BookTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.startswith(f"{BOOK_DIR.name}/") and Path(path).name in HANDED_OFF:
                return "solutions"
            if path.startswith(f"{BOOK_DIR.name}/") or Path(path).name in BOOK_TESTS:
                return "book"
            return "solutions" if path.startswith("solutions/") else path

    return BookTogether(config, log)


def pytest_collection_modifyitems(session, config, items):
    for item in filter(_is_book_cell, items):
        path = Path(str(item.fspath))
        _code_cells[path] = _code_cells.get(path, 0) + 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep the outputs of every book cell that nbval ran and found as stored."""
    report = (yield).get_result()
    if call.when == "call" and report.passed and _is_book_cell(item):
        path = Path(str(item.fspath))
        _executed.setdefault(path, {})[item.cell_num] = list(item.test_outputs or [])
        if path.name in HANDED_OFF and len(_executed[path]) == _code_cells[path]:
            import nbformat

            HANDED_OFF_DIR.mkdir(parents=True, exist_ok=True)
            partial = HANDED_OFF_DIR / f"{path.name}.partial"
            nbformat.write(_with_outputs(path, _executed[path]), partial)
            partial.replace(HANDED_OFF_DIR / path.name)  # whole or absent, never half-written


def _cache_executed_pages() -> None:
    """Put each book page whose every cell passed nbval, with its fresh outputs, in the build's
    execution cache (the cache Jupyter Book reads with `execute_notebooks: cache`)."""
    import nbformat
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    cache = get_cache(str(EXECUTION_CACHE))
    for path, n_cells in _code_cells.items():
        fresh = _executed.get(path, {})
        if len(fresh) == n_cells:
            notebook = _with_outputs(path, fresh)
        elif (HANDED_OFF_DIR / path.name).exists():  # run, and passed, on another worker
            notebook = nbformat.read(HANDED_OFF_DIR / path.name, as_version=4)
        else:
            continue  # not run, or a cell failed: the build executes this page itself
        cache.cache_notebook_bundle(CacheBundleIn(notebook, str(path)), overwrite=True)


def _with_outputs(path: Path, fresh: dict[int, list]):
    """The book page at `path` with nbval's fresh outputs in its code cells."""
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for number, cell in enumerate(code):
        cell.outputs, cell.execution_count = fresh[number], number + 1
    return notebook


@pytest.fixture(scope="session")
def book_html() -> Path:
    """Build the book with warnings as errors and return the HTML folder.

    Pages that nbval already executed in this run come from the execution cache.
    """
    _cache_executed_pages()
    command = [
        str(Path(sys.executable).parent / "jupyter-book"),
        "build",
        str(ROOT),
        "--warningiserror",
        "--nitpick",
        "--keep-going",
    ]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"the book build failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}")
    return BUILD_DIR / "html"
