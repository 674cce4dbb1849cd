"""A cluster job's launch, rehearsed on one machine: `ntp-coordinator` and srun-like tasks started the way
the README's batch script starts them (separate processes, each with the variables `srun` gives a task;
nothing forked by `ntp-train`), on CPU and gloo.  Used by `bench/cluster_live.py` and the tests.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def task_env(procid: int, ntasks: int, port: int, secret: str, *, coordinator: bool = True,
             job_id: int = 4242, step_id: int = 0) -> dict[str, str]:
    """The environment `srun --ntasks=NTASKS` gives task PROCID on one node, plus the batch script's
    MASTER_ADDR/MASTER_PORT, NTP_JOB_SECRET and (with a coordinator) NTP_COORDINATOR."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NTP_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "TORCHELASTIC"))}
    env.update(
        SLURM_JOB_ID=str(job_id), SLURM_STEP_ID=str(step_id), SLURM_PROCID=str(procid),
        SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(procid), SLURM_NODEID="0", SLURM_NNODES="1",
        SLURM_TASKS_PER_NODE=str(ntasks), SLURM_STEP_TASKS_PER_NODE=str(ntasks),
        SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_JOB_NAME="ntp-rehearsal",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NTP_JOB_SECRET=secret,
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
    )
    if coordinator:
        env["NTP_COORDINATOR"] = f"127.0.0.1:{port}"
    return env


class Proc:
    """A started process whose output lines are kept with the time each arrived."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        self.name = name
        self.popen = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, text: str, timeout_s: float) -> float:
        """Time the first line containing `text` arrived (waits for it)."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for t, line in list(self.lines):
                if text in line:
                    return t
            if self.popen.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        raise TimeoutError(f"{self.name}: no line with {text!r} in {timeout_s:.0f} s; output:\n"
                           f"{self.output[-4000:]}")

    def wait(self, timeout_s: float) -> int:
        rc = self.popen.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        return rc

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def start_coordinator(overrides: list[str], port: int, secret: str, cwd: Path,
                      timeout_s: float = 120.0) -> Proc:
    env = task_env(0, 1, port, secret, coordinator=False)
    for k in [k for k in env if k.startswith("SLURM_")]:
        del env[k]  # started by the batch script, not by srun
    proc = Proc("coordinator", [sys.executable, "-m", "ntp_nemo.cli.coordinator", *overrides], env, cwd)
    proc.wait_for("coordinator ready on", timeout_s)
    return proc


def start_task(overrides: list[str], procid: int, ntasks: int, port: int, secret: str, cwd: Path, *,
               coordinator: bool = True, step_id: int = 0) -> Proc:
    env = task_env(procid, ntasks, port, secret, coordinator=coordinator, step_id=step_id)
    return Proc(f"task {procid} (step {step_id})", [sys.executable, "-m", "ntp_nemo.train", *overrides],
                env, cwd)
