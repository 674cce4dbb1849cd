"""`dashboard.port=N`: `ntp-dashboard` beside a run, in a process of its own that the launching process
starts and stops; the workers never see it.

It starts with the job, before the run directory exists (the page shows the run as not started until it
does), prints its URL once, and stops when the job ends, or by itself when the process that started it
is gone (a `kill -9` of `ntp-train`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ntp_nemo.errors import ConfigError

STOP_WAIT_S = 10.0


def command(run_dir: Path, port: int, host: str) -> list[str]:
    return [sys.executable, "-m", "ntp_nemo.cli.dashboard", str(run_dir), "--port", str(port), "--host", host,
            "--parent", str(os.getpid())]


@contextlib.contextmanager
def dashboard_beside(settings: Any, run_dir: Path, enabled: bool = True) -> Iterator[subprocess.Popen | None]:
    """Serve `run_dir` while the block runs when `settings.port` (the `dashboard` config group) is set."""
    port = getattr(settings, "port", None) if settings is not None else None
    if port is None or not enabled:
        yield None
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError("dashboard.port", f"{port!r} is not a TCP port: give 0 (any free port) to 65535, "
                                            "or leave it unset (null) for no dashboard.")
    proc = subprocess.Popen(command(Path(run_dir).resolve(), port, str(settings.host)),
                            stdin=subprocess.DEVNULL, start_new_session=True)  # Ctrl-C is the job's to handle
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_WAIT_S)
