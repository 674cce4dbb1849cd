"""A warm interpreter for the suite's command runs (`tests.conftest.run_cli`): one process per test
worker that has imported what `ntp-train` imports (torch, Lightning, Hydra, the project) and forks a
child per command, so that a command pays its own work and not the interpreter's ~5 s of imports again.

The child is the command as a fresh `python -m MODULE ARGS` would run it: its own process, its own
process group, with the caller's arguments, working directory, environment, umask and resource limits,
stdin from /dev/null, stdout and stderr on the caller's pipes (passed over the socket), signal
dispositions back to an interpreter's defaults, `sys.argv` and `sys.path[0]` as `-m` sets them, and the
module run as `__main__` (`runpy`).  The rest of `sys.path` is the server's: a `PYTHONPATH` of the
command's own environment is not read again.  What a fresh interpreter adds besides imports (the
console scripts' start-up, the import-time choices such as `ntp-train`'s fast config errors before
Hydra) is covered by the tests that start real processes (`tests/cli/test_startup_imports.py`, the
signal and stop tests, which use `subprocess` directly); `tests/house/test_warm_cli.py` compares a
warm and a fresh run of the same commands.

    python -m tests.warm_cli SOCKET     # the server (started by `start`)

Protocol, one connection per command: the client sends one JSON line ({"module", "argv", "cwd", "env",
"umask", "limits"}) with its stdout and stderr write ends attached (SCM_RIGHTS); the server answers
`pid N` once the child runs, and `exit CODE` when it has ended (a negative code: killed by that signal,
as `subprocess` reports it).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.waits import wait_until

LIMITS = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")}


# ---- the server ------------------------------------------------------------------------------------------
def _become(request: dict, out_fd: int, err_fd: int) -> None:
    """In the forked child: take the command's place, then run its module as `__main__`.  Whatever it
    raises goes up to the interpreter as it would from `python -m` (a traceback and exit 1, SystemExit's
    code, death by SIGINT on a KeyboardInterrupt), and the interpreter's exit runs the atexit handlers
    and waits for the command's threads."""
    os.setpgid(0, 0)
    for sig in range(1, signal.NSIG):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has them
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (null, out_fd, err_fd):
        os.close(fd)
    os.umask(int(request["umask"]))
    for name, (soft, hard) in request["limits"].items():
        if name in LIMITS and resource.getrlimit(LIMITS[name]) != (soft, hard):
            resource.setrlimit(LIMITS[name], (soft, hard))
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()
    sys.argv = ["-m", *request["argv"]]
    import runpy
    import warnings

    module = request["module"]
    # The server imported the module as a library already (`python -m` then holds it twice as well: the
    # command imports its own module's package code); runpy's note about that is not the command's output.
    warnings.filterwarnings("ignore", message=f"'{module}' found in sys.modules after import of package",
                            category=RuntimeWarning)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _serve(path: str) -> tuple[dict, int, int]:
    """Serve commands until the test worker is gone (then exit); in each forked child, return its
    request and its stdout and stderr descriptors."""
    import logging

    # The imports every command shares.  Lightning adds a console handler of its own at import unless the
    # root logger has one; `ntp-train` imports it after Hydra has configured logging, so it is imported
    # here with a handler on the root logger, as it is then.
    placeholder = logging.NullHandler()
    logging.getLogger().addHandler(placeholder)
    import hydra  # noqa: F401
    import lightning.pytorch  # noqa: F401
    import torch  # noqa: F401

    import ntp_nemo.cli.train  # noqa: F401
    import ntp_nemo.lightning.factory  # noqa: F401

    logging.getLogger().removeHandler(placeholder)

    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    server.settimeout(1.0)
    while os.getppid() == parent:  # the test worker gone: so is this server
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        while not msg.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                break
            msg += more
        request = json.loads(msg)
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            return request, fds[0], fds[1]
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(f"pid {pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass  # the client gave up (its timeout)
        finally:
            conn.close()
    sys.exit(0)


# ---- the client ------------------------------------------------------------------------------------------
ENV = "NTP_TEST_WARM_CLI"  # the socket of this test worker's server (set by `start`)


def start(directory: Path) -> subprocess.Popen:
    """Start this test worker's server in the background (it takes the imports' ~5 s; `run` waits for
    it) and name its socket in the environment."""
    path = str(directory / "warm_cli.sock")
    proc = subprocess.Popen([sys.executable, "-m", "tests.warm_cli", path],
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent)
    os.environ[ENV] = path
    return proc


def _connect(path: str, timeout_s: float = 180.0) -> socket.socket:
    """Connect to the server, waiting while it imports (it binds its socket once they are done)."""
    def attempt() -> socket.socket | None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            return None

    return wait_until(attempt, timeout_s, f"the warm interpreter's socket {path}", poll_s=0.05)


def run(module: str, argv: list[str], cwd: Path, env: dict[str, str], timeout: float
        ) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` in `cwd` with `env` through this worker's server, as
    `subprocess.run(..., capture_output=True, text=True, timeout=timeout)` would run it."""
    umask = os.umask(0)
    os.umask(umask)
    limits = {name: resource.getrlimit(value) for name, value in LIMITS.items()}
    request = {"module": module, "argv": list(argv), "cwd": str(cwd), "env": env, "umask": umask,
               "limits": limits}
    conn = _connect(os.environ[ENV])
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [out_w, err_w])
    finally:
        os.close(out_w)
        os.close(err_w)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}

    def drain(fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            while block := f.read1(1 << 16):
                chunks[fd].append(block)

    readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_r, err_r)]
    for t in readers:
        t.start()

    def text(fd: int) -> str:
        return b"".join(chunks[fd]).decode(errors="replace")

    deadline = time.monotonic() + timeout
    lines = conn.makefile("r")
    pid = code = None
    try:
        conn.settimeout(timeout)
        pid = int(lines.readline().split()[1])
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        code = int(lines.readline().split()[1])
    except (TimeoutError, OSError, IndexError, ValueError) as err:
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # the command and the workers it forked
            except ProcessLookupError:
                pass
        for t in readers:
            t.join(timeout=10)
        if isinstance(err, TimeoutError):
            raise subprocess.TimeoutExpired([module, *argv], timeout, output=text(out_r),
                                            stderr=text(err_r)) from None
        raise RuntimeError(f"the warm interpreter failed to run {module} {argv}: {err!r}") from err
    finally:
        lines.close()
        conn.close()
    for t in readers:  # every process holding the pipes (forked workers too) has closed them
        t.join(timeout=max(1.0, deadline - time.monotonic()))
    return subprocess.CompletedProcess([sys.executable, "-m", module, *argv], code, text(out_r), text(err_r))


if __name__ == "__main__":
    _become(*_serve(sys.argv[1]))
