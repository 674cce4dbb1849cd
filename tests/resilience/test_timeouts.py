"""The timeout table of docs/failover.md, row by row: each bound is detected, named and acted on.

The monitors are fed what the real workers write (heartbeat files, `heartbeat.Heartbeat`'s format) by
forked stand-in workers that start, report and then stop making progress in the way each row catches.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from ntp_nemo.config.schema import FaultConfig
from ntp_nemo.errors import ConfigError
from ntp_nemo.resilience.beats import beat_path
from ntp_nemo.resilience.detection import WorkerMonitor, classify
from ntp_nemo.resilience.fault_config import Timeouts

FORK = mp.get_context("fork")
T = Timeouts(heartbeat_s=0.6, collective_s=1.2, step_s=3.0, startup_s=2.2)


def _beat(directory: Path, rank: int, phase: str, step: int = 0) -> None:
    """One heartbeat, as `heartbeat.Heartbeat.beat` writes it."""
    path = beat_path(directory, rank)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "phase": phase, "t": time.time(), "pid": os.getpid()}))
    os.replace(tmp, path)


def _worker(directory: Path, rank: int, script: str) -> None:
    """A stand-in worker: `script` says how far it gets before it stops making progress."""
    if script == "silent":  # never past the rendezvous: no heartbeat at all
        time.sleep(60)
    _beat(directory, rank, "setup")
    if script == "setup":  # joined, then stuck before training (a restore, a model build)
        time.sleep(60)
    _beat(directory, rank, "train_start")
    _beat(directory, rank, "step_start", 1)
    if script == "hang":  # stuck inside step 1, silent
        time.sleep(60)
    _beat(directory, rank, "step_end", 1)
    if script == "busy":  # alive and reporting, but no step ever completes (an endless validation)
        for _ in range(600):
            _beat(directory, rank, "validation", 1)
            time.sleep(0.1)
    while True:  # "steps": healthy, a step every 0.1 s
        for step in range(2, 10**6):
            _beat(directory, rank, "step_start", step)
            time.sleep(0.1)
            _beat(directory, rank, "step_end", step)


def _start(directory: Path, scripts: list[str]) -> list:
    procs = [FORK.Process(target=_worker, args=(directory, r, s), daemon=True) for r, s in enumerate(scripts)]
    for p in procs:
        p.start()
    return procs


def _watch(tmp_path: Path, scripts: list[str], stop_requested=lambda: None, limit_s: float = 20.0,
           timeouts: Timeouts = T):
    """Run a `WorkerMonitor` over stand-in workers until it acts; (verdict, seconds, exit codes)."""
    procs = _start(tmp_path, scripts)
    monitor = WorkerMonitor(lambda: procs, tmp_path, len(procs), timeouts, poll_s=0.05,
                            stop_requested=stop_requested)
    t0 = time.time()
    monitor.start()
    monitor.join(limit_s)
    took = time.time() - t0
    alive = monitor.is_alive()
    monitor.stop()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    assert not alive, f"the monitor did not act within {limit_s} s"
    return monitor, took, [p.exitcode for p in procs]


def test_heartbeat_row(tmp_path):
    """fault.heartbeat_timeout_s: a training rank silent this long is blamed and the workers killed."""
    monitor, took, codes = _watch(tmp_path, ["steps", "hang"])
    v = monitor.verdict
    assert v.reason == "heartbeat" and v.ranks == (1,)
    assert T.heartbeat_s <= took < T.collective_s + 1.0
    assert codes == [-9, -9] and monitor.killed == {0, 1}


def test_collective_row():
    """fault.collective_timeout_s: a rank waiting this long in a collective raises, and the supervisor
    reads that failure as a collective timeout (recoverable), not as a bug."""
    import torch
    import torch.distributed as dist

    def rank0(port: int, q) -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=10))
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=1))
        t0 = time.time()
        try:
            dist.all_reduce(torch.ones(1))  # rank 1 never comes to it
            q.put(("returned", 0.0))
        except RuntimeError as err:
            q.put((str(err), time.time() - t0))

    def rank1(port: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
        dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=1))
        time.sleep(30)

    from ntp_nemo.resilience.rendezvous import free_port

    port, q = free_port(), FORK.SimpleQueue()
    a, b = FORK.Process(target=rank0, args=(port, q)), FORK.Process(target=rank1, args=(port,), daemon=True)
    a.start()
    b.start()
    a.join(30)
    b.kill()
    text, waited = q.get()
    assert 0.9 < waited < 10, text
    lost = classify([1, -9], {1}, None, text, (1,), 3)
    assert lost is not None and lost.reason == "collective timeout" and lost.ranks == (1,)


def test_step_row(tmp_path):
    """fault.step_timeout_s: heartbeats advance but no step completes: the step bound names it."""
    monitor, took, codes = _watch(tmp_path, ["busy", "busy"])
    v = monitor.verdict
    assert v.reason == "step timeout" and "fault.step_timeout_s=3" in v.detail
    assert T.step_s <= took < T.step_s + 2.0
    assert codes == [-9, -9]


def test_startup_row(tmp_path):
    """fault.startup_timeout_s: a worker that joined but does not start training is blamed.  The healthy
    worker's heartbeat bound is well above the start-up bound here: a stand-in beating every 0.1 s was
    once starved for 0.6 s on a loaded machine and blamed first."""
    t = Timeouts(heartbeat_s=5.0, collective_s=6.0, step_s=10.0, startup_s=2.2)
    monitor, took, codes = _watch(tmp_path, ["steps", "setup"], timeouts=t)
    v = monitor.verdict
    assert v.reason == "startup timeout" and v.ranks == (1,) and "fault.startup_timeout_s=2.2" in v.detail
    assert t.startup_s <= took < t.heartbeat_s
    assert codes == [-9, -9]


def test_rendezvous_row(tmp_path):
    """fault.collective_timeout_s at start-up: a worker never past its rendezvous is caught by the
    supervisor too (a worker stuck before its rendezvous never raises)."""
    monitor, took, codes = _watch(tmp_path, ["silent", "silent"])
    v = monitor.verdict
    assert v.reason == "rendezvous timeout" and v.ranks == () and "fault.collective_timeout_s" in v.detail
    assert T.collective_s + T.heartbeat_s <= took < T.startup_s + 1.0
    assert codes == [-9, -9]


def test_stop_row(tmp_path):
    """A stop signal (SIGTERM, Ctrl-C) to workers that cannot checkpoint: killed after the grace."""
    asked: list[float] = []

    def stop_requested() -> float:  # the signal reaches the launcher once the monitor watches
        if not asked:
            asked.append(time.time())
        return asked[0]

    monitor, took, codes = _watch(tmp_path, ["steps", "steps"], stop_requested=stop_requested)
    v = monitor.verdict
    assert v.reason == "stop timeout" and "stop signal" in v.detail
    assert T.stop_grace_s <= took < T.stop_grace_s + 1.5
    assert codes == [-9, -9]


def test_live_monitor_enforces_the_step_and_startup_bounds(tmp_path):
    """The live path's monitor enforces the same bounds (it enforced only the heartbeats)."""
    from ntp_nemo.resilience.live_launcher import LiveMonitor

    for scripts, reason in ((["busy", "busy"], "step timeout"), (["steps", "setup"], "startup timeout")):
        d = tmp_path / reason.replace(" ", "_")
        d.mkdir()
        procs = _start(d, scripts)
        launcher = SimpleNamespace(procs=procs, store=object(), lost=set(), stop_requested=None)
        monitor = LiveMonitor(launcher, 2, d, T.heartbeat_s, timeouts=T)
        t0 = time.time()
        monitor.start()
        monitor.join(20)
        took = time.time() - t0
        assert not monitor.is_alive()
        for p in procs:
            p.join(5)
        assert monitor.verdict.reason == reason, monitor.verdict
        assert took < T.step_s + 2.0
        assert [p.exitcode for p in procs] == [-9, -9]


def test_startup_timeout_is_validated():
    with pytest.raises(ConfigError) as err:
        Timeouts.from_config(FaultConfig(startup_timeout_s=0))
    assert "fault.startup_timeout_s" in str(err.value) and "got 0.0" in str(err.value)
    t = Timeouts.from_config(FaultConfig(heartbeat_timeout_s=10, collective_timeout_s=30, step_timeout_s=120))
    assert (t.startup_s, t.rejoin_s, t.stop_grace_s) == (600.0, 150.0, 20.0)


@pytest.mark.slow
def test_sigterm_to_a_run_whose_worker_hangs_ends_it_within_the_bound(tmp_path):
    """A scheduler's SIGTERM to a run with a hung rank: the rank cannot checkpoint, so the supervisor
    kills the workers within its bounds and the command ends (exit 1, the reason and the resume hint)
    instead of relaunching as if nothing had been asked."""
    import signal
    import subprocess

    from tests.conftest import TINY, start_cli_until_step

    run = tmp_path / "run"
    args = [*TINY, "mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=null", "trainer.max_steps=8",
            "checkpoint.every_n_steps=2", "fault=hang", "fault.rank=1", "fault.step=4",
            # a loaded 2-core machine has steps of several seconds: the heartbeat bound leaves room for them
            "fault.heartbeat_timeout_s=15", "fault.collective_timeout_s=30", "fault.step_timeout_s=120",
            f"hydra.run.dir={run}"]
    proc = start_cli_until_step(args, tmp_path, run, 4)  # rank 1 hangs as step 4 starts
    sent = time.time()
    os.killpg(proc.pid, signal.SIGTERM)  # what a scheduler sends to the job before killing it
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running 90 s after SIGTERM:\n{proc.communicate()[0]}")
    took = time.time() - sent
    assert proc.returncode == 1, out
    assert "stopped on a stop signal" in out and "resume=auto" in out and "step_000002" in out, out
    assert "attempt 1" not in out  # no relaunch after the stop was asked
    assert took < 2 * 15 + 20, took  # the stop grace (2 x fault.heartbeat_timeout_s) and the exit
    assert "Traceback" not in out, out
    # The killed workers wrote no end: the launcher records it after the failure (fault campaign seed 3,
    # row 28: a store wipe then SIGTERM left goodput.jsonl ending at failure_detected).
    events = [json.loads(line)["event"] for line in (run / "goodput.jsonl").read_text().splitlines()]
    last_failure = max(i for i, name in enumerate(events) if name == "failure_detected")
    assert "job_end" in events[last_failure + 1:], events[last_failure:]
