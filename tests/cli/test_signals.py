"""Ctrl-C at every moment of a run, and `kill -9` of the launcher, through the real CLI.

One run directory goes through the moments in turn, each rerun resuming from what the last one
saved: SIGINT to the process group (what a terminal's Ctrl-C sends) during the imports, right after
the workers fork (rendezvous), as the first step starts, and during the final save.  Each answers
with exit 0 within a bound and no traceback; every step is in metrics.jsonl exactly once.  In another
run the launcher alone is killed with SIGKILL: the workers stop without announcing a checkpoint, and
the rerun says that nothing was saved and why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import SINGLE, TINY, read_metrics
from tests.waits import wait_until

TWO = ["mesh.dp=2", "mesh.tp=1", "ntp.replica_tp=null", "checkpoint.every_n_steps=0",
       "checkpoint.save_on_end=true", "trainer.progress_bar=true"]
BOUND_S = 60  # from the signal to the exit, on a loaded 2-core machine


def _interrupt(args: list[str], cwd, marker: str | None, delay_s: float = 0.0, sig: int = signal.SIGINT,
               group: bool = True) -> tuple[int, str, float]:
    """Run `ntp-train ARGS`; when a line contains `marker` (None: `delay_s` after the start) send `sig`
    to the process group (or to the launcher alone). Returns (exit code, output, seconds from the
    signal to the end of the output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "ntp_nemo.train", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    sent: list[float] = []
    began = time.time()  # heartbeats older than this are a previous command's

    def send() -> None:
        if not sent:
            sent.append(time.time())
            (os.killpg if group else os.kill)(proc.pid, sig)

    if marker is None:
        threading.Timer(delay_s, send).start()
    elif marker.startswith("save:"):  # while rank 0's heartbeat says it is saving a checkpoint
        beat = Path(marker[5:]) / "failover" / "heartbeats" / "rank_00000.json"

        def watch_save() -> None:
            while proc.poll() is None and not sent:
                try:
                    doc = json.loads(beat.read_text())
                except (OSError, ValueError):
                    doc = {}
                if doc.get("phase") == "save" and doc.get("step", 0) >= 2:
                    send()
                time.sleep(0.01)

        threading.Thread(target=watch_save, daemon=True).start()
    elif marker.startswith("start:"):  # `delay_s` after rank 0's heartbeat says training started
        beat0 = Path(marker[6:]) / "failover" / "heartbeats" / "rank_00000.json"

        def watch_start() -> None:
            while proc.poll() is None and not sent:
                try:
                    doc = json.loads(beat0.read_text())
                except (OSError, ValueError):
                    doc = {}
                if doc.get("t", 0) >= began and doc.get("phase") in ("train_start", "step_start"):
                    time.sleep(delay_s)
                    send()
                time.sleep(0.01)

        threading.Thread(target=watch_start, daemon=True).start()
    elif marker.startswith("fork:"):  # as soon as the launcher has forked that many workers
        def watch(n: int = int(marker[5:])) -> None:
            while proc.poll() is None and not sent:
                if len(_children(proc.pid)) >= n:
                    send()
                time.sleep(0.02)

        threading.Thread(target=watch, daemon=True).start()
    out = []
    deadline = time.time() + 400
    for line in proc.stdout:
        out.append(line)
        watched = marker is None or marker.startswith(("fork:", "save:", "start:"))
        if not watched and marker in line and not sent:
            time.sleep(delay_s)
            send()
        assert time.time() < deadline, "".join(out[-40:])
    proc.wait(timeout=60)
    text = "".join(out)
    assert sent, f"never reached {marker!r}:\n{text[-3000:]}"
    return proc.returncode, text, time.time() - sent[0]


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _steps(run) -> list[int]:
    return [m["step"] for m in read_metrics(run)]


@pytest.mark.slow
def test_ctrl_c_at_every_moment(tmp_path):
    run = tmp_path / "run"
    args = [*TINY, *TWO, f"hydra.run.dir={run}"]

    # Before training: the imports (Hydra, torch, Lightning), or past them into the job (its config record
    # written, the data prepared) on a fast machine: one line, exit 0, nothing left behind.
    rc, out, took = _interrupt([*args, "trainer.max_steps=4"], tmp_path, None, delay_s=1.5)
    assert rc == 0 and took < BOUND_S, out
    assert "Traceback" not in out and "interrupted (Ctrl-C)" in out and "nothing to save; stopped" in out
    assert not run.exists()

    # Right after the fork (the workers rendezvous and set up): they answer once training starts,
    # after its first step, with a checkpoint.
    rc, out, took = _interrupt([*args, "trainer.max_steps=4"], tmp_path, "fork:2")
    assert rc == 0 and took < BOUND_S, out
    assert "Traceback" not in out and "Interrupted system call" not in out
    assert "interrupted (Ctrl-C): checkpointing at step 1 and stopping" in out
    assert (run / "checkpoints" / "step_000001" / "manifest.json").is_file()
    assert json.loads((run / "summary.json").read_text())["stopped_early"] == "SIGINT"

    # As the first step of the rerun starts: it resumes from step 1 and stops after step 2.
    rc, out, took = _interrupt([*args, "trainer.max_steps=4"], tmp_path, f"start:{run}")
    assert rc == 0 and took < BOUND_S, out
    assert f"resuming from {run / 'checkpoints' / 'step_000001'} (step 1;" in out
    assert "Traceback" not in out and "checkpointing at step 2 and stopping" in out
    assert (run / "checkpoints" / "step_000002" / "manifest.json").is_file()

    # During the final save (the last progress line comes just before it): the save completes.
    rc, out, took = _interrupt([*args, "trainer.max_steps=4"], tmp_path, "step 4/4 |")
    assert rc == 0 and took < BOUND_S, out
    assert "Traceback" not in out
    assert (run / "checkpoints" / "step_000004" / "manifest.json").is_file()
    assert _steps(run) == [1, 2, 3, 4]  # each step once over the four commands


    # During a checkpoint save (every step saves; rank 0's heartbeat says `save`), and during a live
    # recovery (the launcher has just seen rank 1 die): both stop after the step with a checkpoint.
    for name, extra, marker in (
        ("save", ["checkpoint.every_n_steps=1", "trainer.max_steps=40"], "save:"),
        ("live", ["fault=kill_rank", "fault.rank=1", "fault.step=2", "trainer.max_steps=40"], "] lost ("),
    ):
        other = tmp_path / name
        rc, out, took = _interrupt([*TINY, *TWO, *extra, f"hydra.run.dir={other}"], tmp_path,
                                   marker + (str(other) if marker == "save:" else ""))
        assert rc == 0 and took < BOUND_S, out[-3000:]
        assert "Traceback" not in out and "checkpointing at step" in out, out[-3000:]
        step = json.loads((other / "summary.json").read_text())["steps"]
        assert step < 40 and (other / "checkpoints" / f"step_{step:06d}" / "manifest.json").is_file()
        assert _steps(other) == list(range(1, step + 1))


@pytest.mark.slow
def test_kill_int_of_the_launcher_alone_is_a_ctrl_c(tmp_path):
    """`kill -INT` of ntp-train alone (its workers do not get the SIGINT): they stop as on a Ctrl-C, with
    a checkpoint and exit 0, not as on the SIGTERM of a preemption (exit 78)."""
    run = tmp_path / "run"
    rc, out, took = _interrupt([*TINY, *TWO, "trainer.max_steps=40", f"hydra.run.dir={run}"], tmp_path,
                               f"start:{run}", group=False)
    assert rc == 0 and took < BOUND_S, out[-3000:]
    assert "interrupted (Ctrl-C): checkpointing at step" in out and "SIGTERM" not in out, out[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stopped_early"] == "SIGINT" and summary["steps"] < 40


@pytest.mark.slow
def test_kill_9_of_the_launcher(tmp_path):
    """kill -9 of the launcher alone: torch sends the workers SIGINT; they stop and say that no
    checkpoint is written (none could be: the launcher hosted their store); the rerun says why it
    starts from step 1."""
    fresh = tmp_path / "killed"
    rc, out, took = _interrupt([*TINY, *TWO, f"hydra.run.dir={fresh}", "trainer.max_steps=400"], tmp_path,
                               f"start:{fresh}", delay_s=2.0, sig=signal.SIGKILL, group=False)
    assert rc == -signal.SIGKILL and took < BOUND_S, out
    # At the step's end, or in the step when a collective meets the launcher's store gone first.
    assert "(pid " in out and "is gone:" in out and "without a checkpoint" in out, out[-3000:]
    assert "checkpointing at step" not in out and "falling back" not in out
    assert "Traceback" not in out and "frame #" not in out
    assert not (fresh / "checkpoints").exists() or not any((fresh / "checkpoints").iterdir())
    reached = _steps(fresh)[-1]
    summary = fresh / "summary.json"
    stopped = json.loads(summary.read_text()).get("stopped_early") if summary.exists() else None
    # The rerun's note comes from the launching process before any worker starts: one process (the
    # killed run's settings on the one-process layout) says it without forking two workers.
    res = subprocess.run([sys.executable, "-m", "ntp_nemo.train", *TINY, *SINGLE, *TWO[3:],
                          f"hydra.run.dir={fresh}", "trainer.max_steps=1"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    said = (f"no checkpoint in {fresh / 'checkpoints'}: starting from step 1. The previous run in this "
            f"directory reached step {reached} and saved none: ")
    assert said in res.stdout, res.stdout[-3000:]
    assert ("its launching process was killed" in res.stdout) == (stopped == "launcher lost")


def test_parent_gone_sees_a_launcher_whose_main_thread_has_exited(tmp_path):
    """After `kill -9` of a launcher with several threads, its main thread (which forked the workers) may
    exit first: the workers' parent pid is still the launcher's, yet it is going. Reproduced with
    pthread_exit in the main thread of a process whose other thread lives on."""
    out = tmp_path / "seen.txt"
    code = f"""
import ctypes, os, threading, time
from ntp_nemo.lightning.callbacks import parent_gone
launcher = os.getpid()
ready_r, ready_w = os.pipe()
child = os.fork()
if child == 0:
    before = parent_gone(launcher)
    os.write(ready_w, b"1")  # the launcher's main thread exits only after this first look
    deadline = time.time() + 20
    while not parent_gone(launcher) and time.time() < deadline:
        time.sleep(0.01)
    with open({str(out)!r}, "w") as fh:
        fh.write(f"{{before}} {{parent_gone(launcher)}} {{os.getppid() == launcher}}")
    os._exit(0)
import select
select.select([ready_r], [], [], 60)
threading.Thread(target=time.sleep, args=(4,)).start()
ctypes.CDLL(None).pthread_exit(None)
"""
    subprocess.run([sys.executable, "-c", code], timeout=180, check=False)
    wait_until(out.exists, 20, "the child's answer", poll_s=0.05)
    assert out.read_text() == "False True True"


def test_ctrl_c_before_training_removes_the_run_dirs_the_command_made(tmp_path):
    """Ctrl-C before any training step, in the directories this command made (`hydra.run.dir`, checked
    writable before Hydra runs): whether it lands before Hydra's job began (no HydraConfig yet) or after
    the config record was written (the first moment of test_ctrl_c_at_every_moment on a fast machine),
    the handler removes what holds only the command's log and config record, parents it made included;
    a directory holding anything else (a run's metrics), or one that was there before, stays."""
    from ntp_nemo.config.run_dir import LOG_NAMES, RECORD_DIR, check_run_dir_overrides

    bare, recorded, trained = tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c" / "run"
    kept = tmp_path / "old"
    kept.mkdir()
    (kept / LOG_NAMES[0]).write_text("an earlier command's\n")
    pid = os.fork()
    if pid == 0:  # the command's process, where the handler runs (and exits)
        try:
            created = []
            for run in (bare, recorded, trained):
                created += check_run_dir_overrides([f"hydra.run.dir={run}", f"hydra.sweep.dir={kept}"])
            for run in (recorded, trained):  # what the job writes once the config is valid
                (run / RECORD_DIR).mkdir()
                (run / RECORD_DIR / "config.yaml").write_text("trainer: {}\n")
                (run / LOG_NAMES[0]).write_text("ntp_nemo | recipe gpt_tiny\n")
            (trained / "metrics.jsonl").write_text('{"step": 1}\n')
            from ntp_nemo.cli.train import _interrupted

            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            _interrupted(created, signal.SIGINT, None)  # exits
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # with the parents made
    assert (trained / "metrics.jsonl").is_file() and (trained / RECORD_DIR / "config.yaml").is_file()
    assert (kept / LOG_NAMES[0]).is_file()  # what was there before stays
