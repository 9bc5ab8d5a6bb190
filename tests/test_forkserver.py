"""`python tests/forkserver.py ARGS` behaves as `python ARGS` does, measured against the
interpreter itself: what the program sees (argv, working directory, `sys.path[0]`, environment,
standard streams), how it ends (exit status, error messages), signals, and a killed caller.
Only the imports differ: through the server, torch is loaded before the program starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from forkserver import PYTHON, start

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is for Linux")
PROBE = """\
import os, sys
print("preloaded" if "torch" in sys.modules else "fresh")
print(sys.argv, os.getcwd(), sys.path[0], os.environ.get("PROBE"))
print(input(), flush=True)
print("to stderr", file=sys.stderr)
{end}
"""
ENDINGS = {
    "returns": "",
    "exits 3": "sys.exit(3)",
    "exits with a message": "sys.exit('stopped: a message')",
    "raises": "def fails():\n    raise ValueError('bad value')\nfails()",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> dict[str, str]:
    """The environment that names a running fork server: the suite's (`conftest.py`), or one
    started here where the suite started none."""
    if os.environ.get("COURSE_FORKSERVER", "off") != "off":
        yield dict(os.environ)
        return
    path = tmp_path_factory.mktemp("forkserver") / "socket"
    process = start(str(path))
    assert process is not None, "the fork server did not start"
    yield {**os.environ, "COURSE_FORKSERVER": str(path)}
    process.terminate()
    process.wait(timeout=60)


def run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, env={**env, "PROBE": "seen"}, input="from stdin\n", text=True,
        capture_output=True, timeout=300,
    )  # fmt: skip


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_script_sees_and_ends_as_under_python(ending, server, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.format(end=ENDINGS[ending]))
    args = [str(script), "an argument"]
    plain = run([sys.executable, *args], {**server, "COURSE_FORKSERVER": "off"}, tmp_path)
    forked = run([*PYTHON, *args], server, tmp_path)
    assert plain.stdout.startswith("fresh\n") and forked.stdout.startswith("preloaded\n")
    assert forked.stdout.split("\n", 1)[1] == plain.stdout.split("\n", 1)[1]
    assert (forked.returncode, forked.stderr) == (plain.returncode, plain.stderr)


CODE = "import os, sys; print(sys.argv, repr(sys.path[0]), __name__, os.getcwd())"


@pytest.mark.parametrize("args", [["-c", CODE, "x"], ["-m", "probe", "x"]], ids=["-c", "-m"])
def test_code_and_modules_run_as_under_python(args, server, tmp_path):
    (tmp_path / "probe.py").write_text(CODE)  # `-m probe` finds it in the working directory
    plain = run([sys.executable, *args], server, tmp_path)
    forked = run([*PYTHON, *args], server, tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (0, plain.stdout, plain.stderr)


def running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def test_signals_reach_the_program_and_a_killed_caller_takes_it_along(server):
    stop = "import time\ntry:\n    time.sleep(300)\nexcept KeyboardInterrupt:\n    print('stopped')"
    caller = subprocess.Popen(
        [*PYTHON, "-c", stop], env=server, stdout=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    time.sleep(2)
    os.killpg(caller.pid, signal.SIGINT)
    assert caller.communicate(timeout=60) == ("stopped\n", None)
    assert caller.returncode == 0

    wait = "import os, time; print(os.getpid(), flush=True); time.sleep(300)"
    caller = subprocess.Popen(
        [*PYTHON, "-c", wait], env=server, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    program = int(caller.stdout.readline())
    assert program != caller.pid and running(program)
    caller.kill()
    caller.wait()
    deadline = time.monotonic() + 10
    while running(program) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(program), "the program went with its killed caller"
