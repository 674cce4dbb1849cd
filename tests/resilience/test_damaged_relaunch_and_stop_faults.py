"""Faults on top of faults, found by the fault campaign: a relaunch whose every checkpoint is damaged, the
healthy peers of a stopped rank blamed for its hang, and a peer lost while a stop checkpoints."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from ntp_nemo.resilience.beats import Beat, suspects
from ntp_nemo.resilience.detection import WorkerMonitor, blame, process_state, step_verdict
from ntp_nemo.resilience.fault_config import Timeouts
from tests.conftest import TINY, run_cli
from tests.resilience.test_hang_window import silent_ranks
from tests.waits import wait_until


@pytest.mark.slow
def test_a_relaunch_whose_every_checkpoint_is_damaged_stops_with_exit_2(tmp_path):
    """The run's only checkpoint (step 2) gets a flipped data byte as step 3 starts (`corrupt_checkpoint`,
    once the save has committed; the size intact: the launcher's cheap check passes it), then rank 1 dies
    at step 4 (at step 3 it could die before its part of the step-2 save, which would then never commit).
    Live recovery has no copy (one replica), so the restart path relaunches from step 2; its workers
    find the damage as they load, and nothing older is left.  The job stops as `resume=auto` does at
    start when every checkpoint is damaged: exit 2, the checkpoint named with what is wrong with it, the
    fix, no traceback, nothing deleted (it used to exit 1 with each worker's CorruptCheckpointError
    traceback)."""
    run = tmp_path / "run"
    proc = run_cli([*TINY, "mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=[2]", "trainer.max_steps=4",
                    "checkpoint.every_n_steps=2", "fault=kill_rank", "fault.rank=1", "fault.step=4",
                    "fault.recovery=live", "+fault.more=[{kind:corrupt_checkpoint,rank:0,step:2}]",
                    f"hydra.run.dir={run}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    ckpts = run / "checkpoints"
    damaged = ckpts / "step_000002"
    flipped = out.split(f"fault: corrupted {damaged}/", 1)[1].split()[0]  # the file the fault flipped
    assert "failover | attempt 1 on layout (1); resuming from step_000002" in out
    assert (f"error: invalid configuration: resume: {ckpts} holds 1 checkpoint(s) and none is usable "
            f"(step_000002: file {flipped} fails its xxh3_64 check at byte ") in proc.stderr
    assert ("The run stopped: it was relaunched after rank(s) [1] lost at step 4 (exit status: rank 1: 137), "
            "and no checkpoint was left to resume from; nothing was deleted. Repair or restore them and "
            "rerun the same command with resume=auto") in proc.stderr
    assert (damaged / "manifest.json").is_file() and (damaged / flipped).is_file()  # nothing deleted
    attempts = [json.loads(line) for line in (run / "failover" / "attempts.jsonl").read_text().splitlines()]
    assert [a["outcome"] for a in attempts] == ["failed", "no usable checkpoint"]  # not a failure retried


# ---- blaming a hang ------------------------------------------------------------------------------------
def test_the_process_state_reader_sees_a_stopped_process(tmp_path):
    """`process_state` reads what the kernel says of a real process: `T` once it is SIGSTOPped, running or
    sleeping again after SIGCONT, None once it is gone."""
    child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    try:
        assert process_state(child.pid) in ("R", "S")
        os.kill(child.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(child.pid) == "T", 10, "the stopped state (T)", poll_s=0.01)
        os.kill(child.pid, signal.SIGCONT)
        wait_until(lambda: process_state(child.pid) != "T", 10, "the continued state", poll_s=0.01)
        assert process_state(child.pid) in ("R", "S")
    finally:
        child.kill()
        child.join(5)
    assert process_state(child.pid) is None


def _beats(progress: list[tuple[str, int]]) -> dict[int, Beat]:
    return {r: Beat(r, step, phase, 100.0, 1000 + r) for r, (phase, step) in enumerate(progress)}


def test_a_stall_is_blamed_on_the_stopped_rank_not_its_peers_in_the_same_step():
    """Ranks 0-2 wait in step 5 (rank 0 stopped, 1 and 2 blocked on it); rank 3 finished step 5's compute
    and reported it.  Progress alone blames 0, 1 and 2; the state of the processes blames rank 0 alone."""
    beats = _beats([("step_start", 5)] * 3 + [("step_end", 5)])
    stopped = {1000: "T", 1001: "S", 1002: "S", 1003: "R"}.get
    assert suspects(beats, 4) == (0, 1, 2)
    assert blame(beats, 4, stopped) == (0,)
    assert blame(beats, 4, lambda pid: "S") == (0, 1, 2)  # nobody stopped: the ranks behind
    assert blame(beats, 4, lambda pid: None) == (0, 1, 2)  # no /proc to read: the same
    assert blame(beats, 4, lambda pid: "T") == (0, 1, 2)  # the whole job stopped (Ctrl-Z): cannot tell
    traced = {1000: "S", 1001: "S", 1002: "S", 1003: "t"}.get  # a debugger holds rank 3, ahead of the rest
    assert blame(beats, 4, traced) == (3,)
    finished = {**beats, 3: Beat(3, 5, "end", 100.0, 1003)}  # a rank past training is never blamed
    assert blame(finished, 4, lambda pid: "T" if pid == 1003 else "S") == (0, 1, 2)
    timeouts = Timeouts(heartbeat_s=1.0, collective_s=2.0, step_s=10.0, startup_s=10.0)
    verdict = step_verdict(beats, 4, launched=0.0, now=200.0, timeouts=timeouts, state=stopped)
    assert verdict is not None and verdict.ranks == (0,)
    monitor = WorkerMonitor(lambda: [], Path("unused"), 4, timeouts, state=stopped)  # the restart path
    verdict = monitor._stall(beats, now=102.0, launched=0.0)  # every beat 2 s old: a heartbeat stall
    assert verdict is not None and verdict.reason == "heartbeat" and verdict.ranks == (0,)


def test_the_live_monitor_kills_the_stopped_rank_alone_and_gives_the_others_a_fresh_window(tmp_path):
    """Three real workers: 0 and 1 in step 5 (1 SIGSTOPped), 2 a phase ahead; every beat is older than
    the heartbeat timeout.  The live monitor kills process 1 only (by progress alone it killed 0 as
    well), and the beats of the others, still from before the hang, are held against nobody for a full
    heartbeat timeout from that kill."""
    from ntp_nemo.resilience.live_launcher import LiveMonitor

    procs = silent_ranks(tmp_path, [("step_start", 5), ("step_start", 5), ("step_end", 5)])
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        wait_until(lambda: process_state(procs[1].pid) == "T", 20, "process 1 stopped (T)", poll_s=0.01)
        launcher = SimpleNamespace(procs=procs, store=object(), lost=set(), stop_requested=None)
        monitor = LiveMonitor(launcher, 3, tmp_path, 0.5)
        time.sleep(0.7)  # every beat is now older than the heartbeat timeout
        monitor._kill_hung(procs)
        procs[1].join(5)
        assert procs[1].exitcode == -9
        monitor._kill_hung(procs)  # the same stale beats, before the loss is published
        time.sleep(0.2)
        assert [procs[0].exitcode, procs[2].exitcode] == [None, None]
    finally:
        for p in procs:
            p.kill()  # SIGKILL ends a stopped process too
            p.join(5)


# ---- the supervisor's side of a relaunch with no usable checkpoint, in process ---------------------------
class _Proc:
    def __init__(self, code: int) -> None:
        self.exitcode, self.pid, self.sentinel = code, None, None

    def is_alive(self) -> bool:
        return False


class _Attempt:
    """Stands in for one attempt's Lightning Trainer: `fit` runs `work(ckpt_path)` as every worker would,
    then fails the way torch's join reports it: a worker killed (exit 137), or a worker that raised."""

    def __init__(self, work) -> None:
        self.work = work
        self.strategy = SimpleNamespace(launcher=SimpleNamespace(procs=[]))
        self.resumed_from: str | None = None

    def fit(self, module, ckpt_path=None) -> None:
        from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

        self.resumed_from = ckpt_path
        try:
            self.work(ckpt_path)
        except Exception as err:  # noqa: BLE001 - what a worker raises reaches the launcher as its text
            self.strategy.launcher.procs = [_Proc(1)]
            raise ProcessRaisedException(f"\n\n-- Process 0 terminated with the following error:\n{err!r}",
                                         0, 0) from None
        self.strategy.launcher.procs = [_Proc(137)]
        raise ProcessExitedException("process 0 terminated with exit code 137", 0, 0, 137)


def _supervised_run(tmp_path, first_attempt):
    """A one-rank run with checkpoints at steps 1 and 2 (written by `save_checkpoint`); attempt 0 runs
    `first_attempt(ckpt_dir)` and loses its rank; the relaunch loads its checkpoint as a worker does
    (`load_with_fallback` within the run's directory).  Returns the supervisor, the attempts and the error
    the run stopped with."""
    from ntp_nemo.checkpoint import checkpoint_name, load_with_fallback, save_checkpoint
    from ntp_nemo.config.failover import failover_spec
    from ntp_nemo.config.resolve_layout import resolve_layout
    from ntp_nemo.resilience.supervisor import Supervisor
    from ntp_nemo.runtime.runtime import RankPlace
    from ntp_nemo.topology import ResolvedLayout, Topology
    from tests.conftest import SINGLE, compose
    from tests.ntp_cases import GPT, SEED

    cfg = compose([*TINY, *SINGLE, "trainer.max_steps=4", "checkpoint.every_n_steps=1",
                   "fault.policy=restart"])
    model = RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * 4)), 0).build_model(GPT, SEED)
    run_dir = tmp_path / "run"
    attempts: list[_Attempt] = []

    def build(layout, extra, devices, stop_at):
        def load(path):  # a worker's resume: the warnings of its fallback are not this test's
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_with_fallback(path, model, None, fallback=True)

        work = (lambda path: first_attempt(sup.ckpt_dir)) if not attempts else load
        attempts.append(_Attempt(work))
        return attempts[-1], None, None

    sup = Supervisor(failover_spec(cfg), resolve_layout(cfg), run_dir, build)
    for step in (1, 2):
        save_checkpoint(sup.ckpt_dir / checkpoint_name(step), model, None, {"n": step}, step=step)
    with pytest.raises(Exception) as stopped:
        sup.run(sup.build_first(), None)
    return sup, attempts, stopped.value


def test_a_relaunch_stops_when_its_workers_find_every_checkpoint_damaged(tmp_path):
    """Both checkpoints get a flipped data byte during attempt 0 (the `corrupt_checkpoint` fault's own
    function): the launcher's check, which reads no data, passes the newest, so the relaunch resumes from
    it; its worker marks both corrupt as it falls back and raises.  The supervisor stops with
    NoUsableCheckpointError naming both (not the worker's error, not a failure to relaunch again)."""
    from ntp_nemo.checkpoint import NoUsableCheckpointError
    from ntp_nemo.resilience.faults import corrupt_latest_checkpoint

    def damage(ckpt_dir: Path) -> None:
        for step in (1, 2):
            corrupt_latest_checkpoint(ckpt_dir, step)

    sup, attempts, err = _supervised_run(tmp_path, damage)
    assert isinstance(err, NoUsableCheckpointError), repr(err)
    assert attempts[1].resumed_from == str(sup.ckpt_dir / "step_000002")  # no data read before the launch
    assert len(attempts) == 2  # not relaunched again
    msg = str(err)
    assert "holds 2 checkpoint(s) and none is usable (step_000002: file data_" in msg
    assert "; step_000001: file data_" in msg and "xxh3_64 check" in msg
    assert "The run stopped: it was relaunched after rank(s) [0] lost at step " in msg
    assert "(exit status: rank 0: 137), and no checkpoint was left to resume from; nothing was deleted" in msg
    assert all((sup.ckpt_dir / f"step_00000{s}" / "corrupt.json").is_file() for s in (1, 2))  # kept, marked
    outcomes = [json.loads(line)["outcome"] for line in (sup.dir / "attempts.jsonl").read_text().splitlines()]
    assert outcomes == ["failed", "no usable checkpoint"]


def test_a_relaunch_stops_when_the_launchers_check_finds_every_checkpoint_damaged(tmp_path):
    """Both checkpoints truncated during attempt 0: the launcher's check (sizes against the manifest)
    finds none usable and the run stops before any relaunch, with a job_end in goodput.jsonl."""
    from ntp_nemo.checkpoint import NoUsableCheckpointError

    def truncate(ckpt_dir: Path) -> None:
        for ckpt in ckpt_dir.glob("step_*"):
            victim = max(ckpt.glob("data_*.bin"), key=lambda f: f.stat().st_size)
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])

    sup, attempts, err = _supervised_run(tmp_path, truncate)
    assert isinstance(err, NoUsableCheckpointError), repr(err)
    assert len(attempts) == 1
    assert "holds 2 checkpoint(s) and none is usable" in str(err) and "truncated" in str(err)
    assert "The run stopped: it was relaunched after rank(s) [0] lost" in str(err)
    events = [json.loads(line) for line in (sup.run_dir / "goodput.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-2:] == ["failure_detected", "job_end"]
    assert events[-1]["reason"] == "no usable checkpoint"


def test_a_checkpoint_set_aside_as_unreadable_is_passed_over_by_the_fault_and_the_stop_note(tmp_path):
    """A damaged checkpoint that a later save of the same step set aside (`step_000002.unreadable`, as
    `python bench/fault_campaign.py --seed 3` row 27 left it: corrupt@6, a fallback to step 3, step 6
    saved again): the `corrupt_checkpoint` fault's next firing damages the newest real checkpoint instead
    of dying on the name (a traceback ended that run), and a stopped run's summary names the newest
    checkpoint to resume from, not the set-aside one."""
    from ntp_nemo.checkpoint import checkpoint_name, save_checkpoint
    from ntp_nemo.checkpoint.manifest import checkpoint_problem, mark_corrupt
    from ntp_nemo.cli.console import stop_checkpoint_note
    from ntp_nemo.resilience.faults import corrupt_latest_checkpoint
    from ntp_nemo.runtime.runtime import RankPlace
    from ntp_nemo.topology import ResolvedLayout, Topology
    from tests.ntp_cases import GPT, SEED

    model = RankPlace(ResolvedLayout.make(Topology(1, [1], [1] * 4)), 0).build_model(GPT, SEED)
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(ckpts / checkpoint_name(step), model, None, {"n": step}, step=step)
    first = corrupt_latest_checkpoint(ckpts, 2)
    assert first is not None and first.parent.name == "step_000002"
    mark_corrupt(first.parent, "a data file failed its check")  # as a load that falls back marks it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_checkpoint(ckpts / checkpoint_name(2), model, None, {"n": 2}, step=2)  # saved again
    assert (ckpts / "step_000002.unreadable").is_dir() and checkpoint_problem(ckpts / "step_000002") is None

    second = corrupt_latest_checkpoint(ckpts, 3)
    assert second is not None and second.parent.name == "step_000002"
    assert checkpoint_problem(ckpts / "step_000002", verify_data=True) is not None  # the new one, damaged
    assert checkpoint_problem(ckpts / "step_000001") is None
    note = stop_checkpoint_note({"steps": 5}, ckpts)
    assert note == "without a checkpoint (a rerun resumes from the latest, step_000002)"


# ---- a loss during a stop's own checkpoint --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False])
def test_a_peer_lost_during_the_stops_checkpoint_is_recovered_from_and_the_stop_saves(tmp_path, async_save):
    """SIGTERM (a scheduler's preemption) reaches a live-recovery run as step 2 starts, and rank 1 dies
    while the stop's checkpoint is written (`kill_during_save`: the save never commits). The survivors
    recover live and, no next step following in which they would save again, write the checkpoint of the
    step they stopped at once more: the command exits 78 (stopped, the same command continues) instead of
    exit 1 with no checkpoint of that step (`bench/fault_campaign.py --seed 3`, row 9: a loss while a stop
    checkpointed). Asynchronous: the loss shows in the background commit; synchronous: in the save itself.
    The run directory it leaves is what `Supervisor._stop_saved` reads."""
    import subprocess

    from ntp_nemo.checkpoint.manifest import checkpoint_problem
    from tests.conftest import read_metrics, start_cli_until_step

    run = tmp_path / "run"
    args = [*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=null", "trainer.max_steps=8",
            "checkpoint.every_n_steps=0", "checkpoint.save_on_end=true", "fault=kill_during_save",
            "fault.rank=1", "fault.step=1", "fault.recovery=live", f"checkpoint.async_save={async_save}",
            f"hydra.run.dir={run}"]
    proc = start_cli_until_step(args, tmp_path, run, 2)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running 180 s after SIGTERM:\n{proc.communicate()[0]}")
    assert proc.returncode == 78, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    step = summary["steps"]
    assert summary["stopped_early"] == "SIGTERM" and step in (2, 3), summary
    assert "failover | live: process(es) [1] lost" in out, out[-4000:]
    assert "(1,2); training ends on it;" in out, out[-4000:]
    assert f"the checkpoint of step {step} did not commit (a peer was lost during it); the survivors write " \
           "it again" in out, out[-4000:]
    assert "was interrupted by the loss and is not redone" not in out  # it is redone
    assert f"with checkpoint step_{step:06d} saved: exit 78" in out, out[-4000:]
    assert checkpoint_problem(run / "checkpoints" / f"step_{step:06d}", verify_data=True) is None
    assert [m["step"] for m in read_metrics(run)] == list(range(1, step + 1))
    _stop_saved_reads_the_run(run, step)


def _stop_saved_reads_the_run(run: Path, step: int) -> None:
    """`Supervisor._stop_saved` on the directory a stopped run wrote: the stop's checkpoint when it is valid
    and summary.json was written during the attempt; nothing for an older summary, or a damaged checkpoint
    (a stop that lost a worker after its checkpoint committed stands; one that lost its checkpoint does
    not)."""
    from ntp_nemo.resilience.supervisor import Supervisor

    sup = SimpleNamespace(run_dir=run, ckpt_dir=run / "checkpoints")
    written = (run / "summary.json").stat().st_mtime
    saved = run / "checkpoints" / f"step_{step:06d}"
    assert Supervisor._stop_saved(sup, SimpleNamespace(start_t=written - 60)) == saved
    assert Supervisor._stop_saved(sup, SimpleNamespace(start_t=written + 60)) is None  # an earlier attempt's
    data = max((p for p in saved.iterdir() if p.name != "manifest.json"), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as fh:
        fh.truncate(data.stat().st_size // 2)
    assert Supervisor._stop_saved(sup, SimpleNamespace(start_t=written - 60)) is None


@pytest.mark.slow
def test_resume_auto_whose_only_checkpoint_fails_its_data_check_names_every_one(tmp_path):
    """A launcher killed after its run's only checkpoint was damaged with its size intact (fault campaign
    seed 4, rows 19 and 21): the rerun with `resume=auto` passes the launcher's cheap check, the workers
    find the damage while loading and have nothing to fall back to. The command says what `resume=auto`
    says when the launcher's check finds every checkpoint damaged (exit 2, each checkpoint named with what
    is wrong with it, nothing deleted), not the message for a `resume=PATH` the user typed."""
    from tests.conftest import SINGLE

    run = tmp_path / "run"
    args = [*TINY, *SINGLE, "checkpoint.every_n_steps=2", f"hydra.run.dir={run}"]
    first = run_cli([*args, "trainer.max_steps=2"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt = run / "checkpoints" / "step_000002"
    victim = max(ckpt.glob("data_*.bin"), key=lambda p: p.stat().st_size)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    proc = run_cli([*args, "trainer.max_steps=4", "resume=auto"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (f"error: invalid configuration: resume: {run / 'checkpoints'} holds 1 checkpoint(s) and none is "
            f"usable (step_000002: file {victim.name} fails its xxh3_64 check at byte ") in proc.stderr, \
        proc.stderr[-3000:]
    assert ("The workers found the damage in step_000002 while loading it, before training a step; nothing "
            "was deleted. Repair or restore them and rerun the same command with resume=auto") in proc.stderr
    assert "resume=auto to continue from the latest valid checkpoint" not in proc.stderr  # not resume=PATH's
    assert victim.is_file() and (ckpt / "manifest.json").is_file()
