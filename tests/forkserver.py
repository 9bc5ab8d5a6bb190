"""Start Python processes without paying for their imports: `python tests/forkserver.py ARGS`
runs like `python ARGS` (a script, `-m module` or `-c code`, with its arguments), in a process
forked from a server that has already imported torch, TransformerLens (and with it
`transformers`) and ipykernel: about 10 s a process on a 2-core machine, paid once.

The suite starts one server (`conftest.py`) and names its socket in `$COURSE_FORKSERVER`;
notebook kernels, the README's commands and torchrun's ranks start through it. Without the
variable, or without a server answering, the client becomes plain `python ARGS`.

The child is what `python ARGS` would be from the caller: its argv, working directory,
environment, standard streams (the client's own, passed over the socket), `sys.path[0]`, fresh
random seeds, its own session, and the interpreter's exit (threads joined, `atexit` run,
streams flushed, the status), only without tearing down every module. The client waits for it,
passes on the signals it gets (so interrupting a kernel works) and exits as it did; a client
that is killed takes the child with it.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import types

VARIABLE = "COURSE_FORKSERVER"
PRELOAD = ("torch", "transformer_lens", "ipykernel.kernelapp")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)
HEADER = struct.Struct("!I")  # the request's length, sent with the three stream descriptors
PYTHON = [sys.executable, os.path.abspath(__file__)]  # in a command, in place of `python`


# The client -------------------------------------------------------------------------------


def signal_group(pid: int, signum: int) -> None:
    """Signal a child's process group, or the child alone before it has made its group."""
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # already gone


def client(args: list[str]) -> None:
    """Run `python ARGS` in a forked child and exit as it exits; where no server takes the
    request, run plain `python ARGS` instead."""
    path = os.environ.get(VARIABLE, "")
    forkable = bool(args) and (args[0] in ("-m", "-c") or not args[0].startswith("-"))
    request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if not (forkable and path.startswith("/")):
            raise ConnectionError("no fork server to ask")
        server.connect(path)  # queued while the server imports
        socket.send_fds(server, [HEADER.pack(len(request))], [0, 1, 2])
        server.sendall(request)
        replies = server.makefile("r")
        child = int(replies.readline())  # empty (ValueError) if the server went
    except (OSError, ValueError):  # no server, or a standard stream closed
        os.execv(sys.executable, [sys.executable, *args])

    def reply() -> int:
        line = replies.readline()
        if not line:
            sys.exit(f"{__file__}: the fork server stopped before the program ended")
        return int(line)

    for signum in FORWARDED:
        signal.signal(signum, lambda signum, frame: signal_group(child, signum))
    status = reply()
    if os.WIFSIGNALED(status):  # die of the same signal
        if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


# The server -------------------------------------------------------------------------------


def start(path: str, wait_s: float = 30.0):
    """Start a server on the socket `path` and return its process once it listens (it listens
    first, then imports); None if it did not come up."""
    import subprocess
    import time

    server = subprocess.Popen(
        [*PYTHON, "--serve", path], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
    )
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if os.path.exists(path):
        return server
    server.kill()
    server.wait()
    return None


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    (size,) = HEADER.unpack(header)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk or len(fds) != 3:
            raise ValueError("the client hung up before its request was whole")
        body += chunk
    return json.loads(body), fds


def hung_up(conn: socket.socket) -> bool:
    """Whether a readable client connection has closed: a client never writes after asking."""
    try:
        return not conn.recv(1)
    except OSError:
        return True


def serve(path: str) -> tuple[dict, list[int]]:
    """Answer requests until the parent goes or SIGTERM comes; return only in a forked child,
    with its request and the client's streams."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)  # first: clients queue while it imports, and see at once if it dies
    listener.listen(64)
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the children's collections leave the server's objects, and its pages, alone
    children: dict[int, socket.socket | None] = {}  # pid -> its client's connection
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    try:
        job = answer(listener, children, parent)
    except (SystemExit, KeyboardInterrupt):
        job = None
    if job is None:  # the server ends, and its children with it
        for pid in children:
            signal_group(pid, signal.SIGKILL)
        sys.exit(0)
    return job


def answer(
    listener: socket.socket, children: dict[int, socket.socket | None], parent: int
) -> tuple[dict, list[int]] | None:
    """Fork a child per request and tell each client its child's pid, then its exit status;
    kill the child of a client that dies. None when the server's parent has gone."""
    while os.getppid() == parent:
        connections = [conn for conn in children.values() if conn is not None]
        ready = select.select([listener, *connections], [], [], 0.2)[0]
        if listener in ready:
            conn = listener.accept()[0]
            try:
                request, fds = receive(conn)
            except (OSError, ValueError, struct.error):  # a client that died while asking
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in [conn, *connections]:
                    other.close()
                return request, fds
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        for pid, conn in list(children.items()):
            if conn in ready and hung_up(conn):
                conn.close()
                children[pid] = None
                signal_group(pid, signal.SIGKILL)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{status}\n".encode())
                except OSError:
                    pass  # the client died as the child did
                conn.close()
    return None


def become(request: dict, fds: list[int]) -> None:
    """Turn this forked child into `python ARGS` as the client would have started it."""
    os.setsid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = open(0, closefd=False)  # noqa: SIM115
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = open(fd, "w", closefd=False)  # noqa: SIM115
        stream.reconfigure(line_buffering=fd == 2 or os.isatty(fd), write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    import numpy
    import torch

    torch.seed()
    numpy.random.seed()
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def run(args: list[str]) -> None:
    """What the interpreter does with `python ARGS`."""
    if args[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *args[2:]], ""
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args[0] == "-m":
        sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv, sys.path[0] = args, os.path.dirname(os.path.realpath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def exit_code(error: BaseException | None) -> int:
    """The interpreter's exit status for how the program ended, its error reported."""
    if isinstance(error, SystemExit):
        if error.code is None or isinstance(error.code, int):
            return error.code or 0
        print(error.code, file=sys.stderr)
        return 1
    if error is not None:
        trace = error.__traceback__  # from the program's first frame, as the interpreter shows
        ours = (run.__code__.co_filename, runpy.run_path.__code__.co_filename)
        while trace and trace.tb_frame.f_code.co_filename in ours:
            trace = trace.tb_next
        error = error.with_traceback(trace or error.__traceback__)  # what the hook prints
        sys.excepthook(type(error), error, error.__traceback__)
        return 1
    return 0


def finish(code: int) -> None:
    """Exit as the interpreter does (threads joined, `atexit` run, streams flushed) but without
    tearing down every module: in a forked child that would copy most of the server's memory,
    seconds a process."""
    import atexit
    import threading

    threading._shutdown()  # what the interpreter calls first on exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        request, fds = serve(sys.argv[2])
        become(request, fds)
        try:
            run(request["args"])
        except BaseException as error:  # noqa: BLE001 - reported as the interpreter would
            finish(exit_code(error))
        finish(0)
    else:
        client(sys.argv[1:])
