"""Hang detection across a change of generation: a survivor is not judged hung by a beat of the step the
failure interrupted while it recovers."""

from __future__ import annotations

import multiprocessing as mp
import time
from types import SimpleNamespace

from ntp_nemo.resilience.beats import read_beats
from ntp_nemo.resilience.heartbeat import Heartbeat
from ntp_nemo.resilience.live_launcher import LiveMonitor
from tests.waits import wait_until


def _rank(directory, rank: int, phase: str, step: int) -> None:
    """A survivor: its last beat (written by the real Heartbeat, with this process's pid), then silence."""
    Heartbeat(directory).beat(SimpleNamespace(global_rank=rank, global_step=step), phase, step)
    time.sleep(60)


def silent_ranks(directory, progress: list[tuple[str, int]]) -> list:
    """Fork one `_rank` per (phase, step) of `progress` and wait (20 s at most) until each has beaten."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(directory, r, ph, st)) for r, (ph, st) in enumerate(progress)]
    for p in procs:
        p.start()
    wait_until(lambda: len(read_beats(directory, len(procs))) == len(procs), 20, "every rank's first beat",
               poll_s=0.05)
    return procs


def test_no_survivor_is_judged_hung_by_a_beat_from_before_its_recovery(tmp_path):
    """Three survivors' last beats come from the interrupted step, one a phase behind the others, and are
    older than the heartbeat timeout when the recovery is slow.  From the loss's publication on, each
    gets a full heartbeat timeout: nobody is killed at once; one that stays silent past it still is."""
    procs = silent_ranks(tmp_path, [("step_start", 5), ("step_end", 4), ("step_start", 5)])
    try:
        launcher = SimpleNamespace(procs=procs, store=object(), lost=set(), stop_requested=None)
        monitor = LiveMonitor(launcher, 3, tmp_path, 0.5)
        time.sleep(0.7)  # every beat is now older than the heartbeat timeout
        monitor.fresh_window()  # a loss was published: the survivors recover
        monitor._kill_hung(procs)
        time.sleep(0.2)
        assert [p.exitcode for p in procs] == [None, None, None]  # nobody killed by a stale beat
        time.sleep(0.5)  # no fresh beat a full heartbeat timeout after the recovery began
        monitor._kill_hung(procs)
        procs[1].join(5)
        assert procs[1].exitcode == -9  # the one behind
        assert [procs[0].exitcode, procs[2].exitcode] == [None, None]
    finally:
        for p in procs:
            p.kill()
            p.join(5)


def test_the_first_compiled_step_is_start_up_not_a_silent_step(tmp_path):
    """With `trainer.compile`, a process's first step compiles the blocks and writes no beat for up to a
    minute: its beat says `setup` (bounded by fault.startup_timeout_s), so the supervisor's monitor does
    not take the compilation for a hang past the heartbeat timeout; from the second step on it beats as
    usual.  Without the option the same silence is a hang."""
    from ntp_nemo.resilience.detection import WorkerMonitor, start_verdict
    from ntp_nemo.resilience.fault_config import Timeouts

    timeouts = Timeouts(heartbeat_s=0.5, collective_s=10.0, step_s=60.0, startup_s=30.0)
    trainer = SimpleNamespace(global_rank=0, global_step=0)
    for compiled in (True, False):
        directory = tmp_path / str(compiled)
        module = SimpleNamespace(compile_blocks=compiled)
        beat = Heartbeat(directory)
        beat.setup(trainer, module, "fit")
        beat.on_train_start(trainer, module)
        beat.on_train_batch_start(trainer, module, None, 0)
        monitor = WorkerMonitor(lambda: (), directory, 1, timeouts, state=lambda rank: None)
        beats = read_beats(directory, 1)
        t0 = beats[0].t
        silent = monitor._stall(beats, t0 + 5.0, t0)  # ten heartbeat timeouts into the first step
        if compiled:
            assert beats[0].phase == "setup" and silent is None
            late = start_verdict(beats, [0], t0, t0 + 31.0, timeouts)
            assert late is not None and late.reason == "startup timeout"  # still bounded
            beat.on_train_batch_end(trainer, module, None, None, 0)  # the step ends: the next beats as usual
            beat.on_train_batch_start(SimpleNamespace(global_rank=0, global_step=1), module, None, 1)
            assert read_beats(directory, 1)[0].phase == "step_start"
        else:
            assert beats[0].phase == "step_start" and silent is not None and silent.reason == "heartbeat"
