"""Faults on top of faults: a relaunch after a live fallback, a failed rejoin, a stop during a rejoin."""

from __future__ import annotations

import gc
import re
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from ntp_nemo.resilience.live_launcher import LiveLauncher
from tests.conftest import TINY, read_metrics, run_cli


def _collect_garbage_bounded() -> None:
    """A worker's garbage collection; SIGALRM (default action: terminate) bounds a destructor that hangs."""
    signal.alarm(20)
    gc.collect()
    signal.alarm(0)


def test_a_relaunch_never_destroys_an_earlier_attempts_store_in_a_worker():
    """An attempt's launcher hosts the job's TCPStore here; when that attempt is over and its objects sit
    in an unreachable reference cycle (as a finished trainer does), the next attempt's workers must not
    be the ones to destroy it: in a forked child the store's server thread does not exist and the
    destructor's join never returns (the relaunch after a live fallback hung forever)."""
    strategy = SimpleNamespace(num_processes=1)
    gc.disable()  # the cycle below stays uncollected until someone collects it on purpose
    try:
        first = LiveLauncher(strategy)
        first.launch(lambda: None)
        assert first.store is not None  # the attempt's store, hosted in this process
        first.cycle = first  # unreachable once `first` goes: collected only by a garbage collection
        del first
        second = LiveLauncher(strategy)
        second.launch(_collect_garbage_bounded)  # raises ProcessExitedException (-14) if the child hung
        assert [p.exitcode for p in second.procs] == [0]
        second.close()
        assert second.store is None
    finally:
        gc.enable()


REJOIN_BASE = [*TINY, "mesh.dp=2", "mesh.tp=1", "ntp.replica_tp=null", "trainer.max_steps=20",
               "checkpoint.every_n_steps=0", "checkpoint.save_on_end=false", "fault.recovery=live"]


def _losses(run: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run)}


@pytest.mark.slow
def test_a_failed_rejoin_cancels_the_rejoin_not_the_job(tmp_path, reference_losses):
    """Rank 1 is lost at step 3 and the survivor goes on alone; the repaired process started in its place
    dies before it joins (`kill_rank` phase `rejoin`): the rejoin is cancelled, the survivor goes on.  The
    next repaired process dies after the launcher decided to take it in, while the rejoin's generation
    forms (phase `joining`): the survivor re-forms its layout without it, live.  A third repair joins, and
    every step lands once on the failure-free loss curve (no checkpoint exists: only the survivor's memory
    carried the run)."""
    run = tmp_path / "run"
    proc = run_cli([*REJOIN_BASE, "fault=kill_rank", "fault.rank=1", "fault.step=3",
                    "fault.repair_after_steps=1",
                    "+fault.more=[{kind:kill_rank,rank:1,step:1,phase:rejoin},"
                    "{kind:kill_rank,rank:1,step:1,phase:joining}]",
                    f"hydra.run.dir={run}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert ("the rejoin of process(es) [1] failed (process(es) [1] exited with status 137); the survivors "
            "go on without them") in out
    assert ("the rejoin of process(es) [1] failed after it was decided (process(es) [1] died): the "
            "survivors re-form without them") in out
    # RendezvousAborted when the notice comes before the survivor's rendezvous, a connection error of the
    # process group when it dies inside it (a loaded machine's timing): re-formed live either way
    assert re.search(r"the rejoin failed \(\w+\); processes \[1\] lost: the survivors re-form layout \(1\)",
                     out), out[-4000:]
    assert "falling back" not in out
    assert "repaired process(es) rejoined: layout (1) -> (1,1)" in out
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 21))  # every step once
    assert metrics[-1]["layout"] == "(1,1)"
    reference = reference_losses("single-20")  # the failure-free curve of TINY at 20 steps
    for step, loss in _losses(run).items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])
    assert (run / "failover" / "attempts.jsonl").read_text().count("\n") == 1  # no relaunch


@pytest.mark.slow
def test_a_survivor_lost_between_a_rejoins_decision_and_its_join_step_is_recovered_live(tmp_path,
                                                                                       reference_losses):
    """Rank 2 of three is lost at step 3; its repair is announced to join two steps ahead and decided (the
    repaired process is ready), and then survivor 1 dies at the start of the step before the join step
    (phase `decided`): the last survivor is still in its generation, the launcher takes the rejoin's
    generation as forming.  The loss is published for the rejoin's generation and the survivor re-forms
    the one after it, live (before, it waited for a notice under its own generation, found none and fell
    back to the restart path).  Both places are repaired later, and every step lands once on the
    failure-free curve."""
    run = tmp_path / "run"
    proc = run_cli([*REJOIN_BASE, "mesh.dp=3", "fault=kill_rank", "fault.rank=2", "fault.step=3",
                    "fault.repair_after_steps=1",
                    "+fault.more=[{kind:kill_rank,rank:1,step:4,phase:decided}]",
                    f"hydra.run.dir={run}"], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert ("the rejoin of process(es) [2] failed after it was decided (process(es) [1] died): the "
            "survivors re-form without them") in out, out[-4000:]
    assert "falling back" not in out, out[-4000:]
    assert "repaired process(es) rejoined: layout (1) -> (1,1,1)" in out, out[-4000:]
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 21))  # every step once
    assert metrics[-1]["layout"] == "(1,1,1)"
    reference = reference_losses("single-20")
    for step, loss in _losses(run).items():
        assert abs(loss - reference[step]) <= 1e-4 * abs(reference[step]), (step, loss, reference[step])
    assert (run / "failover" / "attempts.jsonl").read_text().count("\n") == 1  # no relaunch


@pytest.mark.slow
def test_ctrl_c_during_a_live_rejoin_stops_quietly_with_the_resume_command(tmp_path):
    """Ctrl-C while a repaired process waits to join slow survivors: the survivors checkpoint and stop,
    the repaired process is stopped without a traceback, and the command prints the summary and the
    resume command and exits 0 (a Ctrl-C's code) within a bound.  The repaired process is started after
    step 4 to rejoin before step 7; the survivor's steps 5 and 6 take 3 s each, so the Ctrl-C, 1 s after
    the start, finds it starting or waiting."""
    import os
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    args = [*REJOIN_BASE, "checkpoint.save_on_end=true", "fault=kill_rank", "fault.rank=1", "fault.step=3",
            "fault.repair_after_steps=1", "+fault.more=[{kind:slow,rank:0,step:5,seconds:3,steps:3}]",
            f"hydra.run.dir={run}"]
    proc = subprocess.Popen([sys.executable, "-m", "ntp_nemo.train", *args], cwd=tmp_path, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    lines, sent = [], None
    for line in proc.stdout:  # ends when the command's output closes
        lines.append(line)
        if sent is None and "start and rejoin before step" in line:
            time.sleep(1.0)  # the repaired process is starting or waiting for the survivors
            sent = time.time()
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        if sent is not None and time.time() - sent > 120:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    out = "".join(lines)
    assert sent is not None, out
    assert proc.returncode == 0, out
    assert time.time() - sent < 90, out
    assert "Traceback" not in out and "DistStoreError" not in out, out
    assert "stopped early at step" in out and "(Ctrl-C); checkpoint saved" in out, out
    assert "to resume     ntp-train" in out and f"hydra.run.dir={run}" in out, out


def _sealed_job(tmp_path, stop_requested: float | None):
    """What the live launcher holds while two workers run: the store it hosts, sealed, and a started
    `LiveMonitor` over two sleeping processes.  Returns (monitor, procs, a client of the store with the job's
    secret: something else on this machine)."""
    import multiprocessing as mp
    import time

    from ntp_nemo.resilience.fault_config import Timeouts
    from ntp_nemo.resilience.live_launcher import LiveMonitor
    from ntp_nemo.resilience.rendezvous import connect, free_port, host_store, local_secret, seal_store
    from ntp_nemo.resilience.store_auth import JobStore

    secret, port = local_secret(), free_port()
    store = JobStore(host_store(port), secret)
    seal = seal_store(store)
    procs = [mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    launcher = SimpleNamespace(procs=procs, store=store, seal=seal, lost=set(), stop_requested=stop_requested)
    monitor = LiveMonitor(launcher, 2, tmp_path, 30.0, timeouts=Timeouts(30.0, 60.0, 120.0, 100.0))
    monitor.start()
    return monitor, procs, JobStore(connect(port), secret)


@pytest.mark.parametrize("how", ["deleted", "overwritten"])
def test_a_wiped_or_overwritten_store_is_named_not_blamed_on_the_machine(tmp_path, how):
    """The launcher seals the job's store when it hosts it; keys that vanish or change under the job stop
    the attempt at once with that reason (it waited out the collective timeout, then blamed the machine)."""
    import time

    from ntp_nemo.resilience.rendezvous import SEAL_KEY

    monitor, procs, other = _sealed_job(tmp_path, stop_requested=None)
    time.sleep(1.5)
    assert monitor.is_alive() and monitor.verdict is None  # an intact store: nothing to say
    if how == "deleted":
        other.store.delete_key(SEAL_KEY)
    else:
        other.store.set(SEAL_KEY, b"not the job's")
    t0 = time.time()
    monitor.join(10)
    assert not monitor.is_alive() and time.time() - t0 < 5
    v = monitor.verdict
    assert v.reason == "store wiped" and "coordination keys vanished or changed under it" in v.detail
    for p in procs:
        p.join(5)
    assert [p.exitcode for p in procs] == [-9, -9]


def test_a_store_wiped_while_the_workers_stop_on_a_signal_does_not_kill_them(tmp_path):
    """A stop signal reached the launcher and the workers are checkpointing and stopping when the store's
    keys are wiped: the monitor leaves them to finish (the stop grace bounds it) instead of killing them,
    which ended such a run with exit 1 after its stop checkpoint had committed (`python
    bench/fault_campaign.py --seed 3`, row 28: a wipe and a SIGTERM moments apart)."""
    import time

    from ntp_nemo.resilience.rendezvous import SEAL_KEY

    monitor, procs, other = _sealed_job(tmp_path, stop_requested=time.time())
    try:
        other.store.delete_key(SEAL_KEY)
        time.sleep(2.5)  # the seal is checked every second
        assert monitor.is_alive() and monitor.verdict is None
        assert all(p.is_alive() for p in procs)
    finally:
        monitor.stop()
        monitor.join(5)
        for p in procs:
            p.kill()
            p.join(5)


def test_a_flooded_store_is_named_before_it_exhausts_the_launcher(tmp_path):
    """Something else on the machine writes 64 MiB of values to the store the launcher hosts (the job's
    own keys take a few KiB; before, a flood grew the launcher without bound).  Past the bound on the
    hosting process's growth (32 MiB here, 512 MiB by default), the attempt stops at once, naming it."""
    import multiprocessing as mp
    import time

    from ntp_nemo.resilience.live_launcher import LiveMonitor
    from ntp_nemo.resilience.rendezvous import connect, free_port, host_store, local_secret, seal_store
    from ntp_nemo.resilience.store_auth import JobStore

    port = free_port()
    store = JobStore(host_store(port), local_secret())
    seal = seal_store(store)
    procs = [mp.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    launcher = SimpleNamespace(procs=procs, store=store, seal=seal, lost=set(), stop_requested=None)
    monitor = LiveMonitor(launcher, 2, tmp_path, 30.0, store_growth_mb=32)
    monitor.start()
    time.sleep(1.5)
    assert monitor.is_alive() and monitor.verdict is None  # the job's own use: nothing to say
    outsider = connect(port)  # no secret needed to write to a TCPStore
    for i in range(64):
        outsider.set(f"flood/{i}", b"x" * 2**20)
    t0 = time.time()
    monitor.join(10)
    assert not monitor.is_alive() and time.time() - t0 < 5
    v = monitor.verdict
    assert v.reason == "store flooded" and "something else is writing to the store" in v.detail, v
    for p in procs:
        p.join(5)
    assert [p.exitcode for p in procs] == [-9, -9]


def test_a_step_whose_generation_was_aborted_is_never_applied(monkeypatch):
    """NCCL stand-in: after its generation is aborted, a collective may return garbage without raising.
    The step checks the generation before its optimizer step (as `NTPLanguageModule.training_step`
    does): the garbage is never applied, and the step is redone on the next generation."""
    import threading

    import ntp_nemo.resilience.rendezvous as rendezvous
    from ntp_nemo.resilience.live_worker import GenerationAborted, LiveRecovery, is_collective_failure

    aborted = threading.Event()
    monkeypatch.setattr(rendezvous, "sever", lambda store: aborted.set())  # the stand-in abort
    rec = LiveRecovery("ntp")
    rec.store, rec.generation = object(), SimpleNamespace(index=0)  # a live job in generation 0
    rec.backend = "nccl"  # the job's backend, which this stand-in plays

    def all_reduce(x: float) -> float:  # the stand-in group: garbage, no error, once aborted
        return 1e30 if aborted.is_set() else x

    runs, applied, recoveries = [], [], []

    def training_step(batch: dict) -> float:
        epoch = rec.abort_epoch()
        runs.append(batch["step"])
        if len(runs) == 1:  # the launcher's word arrives while the step's collective is in flight
            threading.Thread(target=rec.interrupt, args=(0, [1])).start()
            aborted.wait(5)
        value = all_reduce(2.0)
        rec.check_generation(epoch)  # before the optimizer step
        applied.append(value)  # the optimizer step
        return value

    def recover(strategy, step: int, phase=None):  # the next generation: sound collectives again
        aborted.clear()
        recoveries.append(step)
        return SimpleNamespace(behind=False, phase=phase)

    rec._recover = recover
    assert rec.run_step(None, training_step, {"step": 4}) == 2.0
    assert runs == [4, 4] and recoveries == [4] and applied == [2.0]  # redone once; garbage never applied
    assert is_collective_failure(GenerationAborted("x"))


def _standin_job(global_step: int):
    """A strategy whose module takes a step as done (`take_step_as_done`), recording what it is given."""
    taken = []
    trainer = SimpleNamespace(global_step=global_step, is_global_zero=False)
    module = SimpleNamespace(
        trainer=trainer, take_step_as_done=lambda batch, note: taken.append((batch["step"], note)) or "done")
    return SimpleNamespace(lightning_module=module), taken


def test_a_survivor_behind_takes_the_step_as_done_and_passes_over_what_the_others_entered():
    """A survivor whose step 4 (batch 3) failed while the survivors ahead had completed it and entered
    a second collective between steps (a checkpoint save, say): it does not run the step again but takes
    it as done with their note, passes over the two collectives they entered (they do not redo them),
    runs the third, and counts afresh from the next step."""
    from ntp_nemo.resilience.live_worker import LiveRecovery
    from ntp_nemo.resilience.recovery import IN_STEP

    rec = LiveRecovery("ntp")
    rec.store, rec.generation = object(), SimpleNamespace(index=0)
    strategy, taken = _standin_job(global_step=3)
    asked, runs = [], []
    rec._recover = lambda strategy, step, phase=None: asked.append((step, phase)) or SimpleNamespace(
        behind=True, phase=2, rank=1, step=4, note={"record": {"step": 4, "loss": 1.5}})

    def step_fn(batch):
        runs.append(batch["step"])
        raise RuntimeError("[gloo] Connection closed by peer")

    assert rec.run_step(strategy, step_fn, {"step": 3}) == "done"
    assert runs == [3] and asked == [(3, IN_STEP)] and taken == [(3, {"record": {"step": 4, "loss": 1.5}})]
    between = [rec.run_between_steps(strategy, lambda i=i: i) for i in range(3)]
    assert between == [None, None, 2]
    rec.before_step(strategy)
    assert rec.run_between_steps(strategy, lambda: "next") == "next"


def test_survivors_between_steps_pass_over_what_the_furthest_entered():
    """A survivor that failed in the first collective between steps, when another had entered the third:
    the first is not redone (as before), the second and third are passed over, the fourth runs; when
    the furthest was inside the next step already, every collective up to that step is passed over."""
    from ntp_nemo.resilience.live_worker import LiveRecovery
    from ntp_nemo.resilience.recovery import IN_STEP

    for front, expect in ((3, [None, None, None, "ran"]), (IN_STEP, [None, None, None, None])):
        rec = LiveRecovery("ntp")
        rec.store, rec.generation = object(), SimpleNamespace(index=0)
        strategy, taken = _standin_job(global_step=5)
        asked = []

        def recover(strategy, step, phase=None, front=front, asked=asked):
            asked.append((step, phase))
            return SimpleNamespace(behind=False, phase=front, note=None)

        rec._recover = recover

        def failing():
            raise RuntimeError("[gloo] Connection closed by peer")

        got = [rec.run_between_steps(strategy, failing)]
        got += [rec.run_between_steps(strategy, lambda: "ran") for _ in range(3)]
        assert got == expect and asked == [(5, 1)] and taken == []
        rec.before_step(strategy)
        assert rec.run_between_steps(strategy, lambda: "ran") == "ran"


def test_a_peer_lost_during_the_memory_reports_gather_is_recovered_like_one_lost_during_a_save(
        monkeypatch, capsys):
    """The memory report's gather (after step 3, every rank) is a collective between steps: a peer lost
    during it (a process stopped, then killed by the heartbeat watch) is recovered from live, as during a
    checkpoint save, and the report is not printed, instead of the error ending the worker and sending
    the job down the restart path (what `python bench/fault_campaign.py --seed 2` found in its scenarios
    21 and 22: a traceback and a restart from the start)."""
    import torch.distributed as dist

    import ntp_nemo.pipeline.memory as memory
    from ntp_nemo.lightning.callbacks import MemoryReport
    from ntp_nemo.resilience.live_worker import LiveRecovery

    rec = LiveRecovery("ntp")
    rec.store, rec.generation = object(), SimpleNamespace(index=0)
    asked = []
    rec._recover = lambda strategy, step, phase=None: asked.append((step, phase)) or SimpleNamespace(
        behind=False, phase=phase, note=None)
    state = object()
    trainer = SimpleNamespace(global_step=3, max_steps=10, is_global_zero=True, optimizers=[],
                              callbacks=[])
    strategy = SimpleNamespace(state=state, lightning_module=SimpleNamespace(trainer=trainer))
    # As `NTPStrategy.between_steps`: the strategy's collectives between steps go through its hooks.
    strategy.between_steps = lambda fn, *args, what=None: rec.run_between_steps(
        strategy, fn, *args, what=what)
    trainer.strategy = strategy
    monkeypatch.setattr(memory, "rank_memory_estimate", lambda *a, **k: "estimate")
    monkeypatch.setattr(memory, "measure_memory", lambda *a, **k: "measured")
    monkeypatch.setattr(memory, "format_side_by_side", lambda est, got: f"{est} / {got}")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def lost_peer(out, obj, group=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    monkeypatch.setattr(dist, "all_gather_object", lost_peer)
    report = MemoryReport(micro_batch_size=2, seq_len=32, global_microbatches=4, after_steps=3)
    report._at, report._state = 3, state  # as `on_train_start` at step 0 sets them
    module = SimpleNamespace(runtime=SimpleNamespace(pipeline=None), model=None)
    report.on_train_batch_end(trainer, module, None, None, 2)
    out = capsys.readouterr().out
    assert asked == [(3, 1)]  # recovered before step 4, the gather being the first collective since step 3
    assert "memory per rank" not in out and "the memory report was interrupted by the loss" in out

    def gathered(out, obj, group=None):
        out[:] = [obj, "rank 1's line"]

    monkeypatch.setattr(dist, "all_gather_object", gathered)
    rec.before_step(strategy)
    report._at, trainer.global_step = 4, 4
    report.on_train_batch_end(trainer, module, None, None, 3)
    assert "rank 0: estimate / measured\n  rank 1: rank 1's line" in capsys.readouterr().out


def _gloo_step_after_an_abort(rank: int, world: int) -> dict:
    """On a gloo world: the coordinator's word of a loss arrives after the step's collectives returned
    and before its update."""
    import torch

    import ntp_nemo.resilience.rendezvous as rendezvous
    from ntp_nemo.resilience.live_worker import GenerationAborted, LiveRecovery

    rendezvous.sever = lambda store: None  # nothing to sever in this one-process world
    rec = LiveRecovery("ntp")
    rec.store, rec.generation = object(), SimpleNamespace(index=0)
    epoch = rec.abort_epoch()
    x = torch.ones(3)
    torch.distributed.all_reduce(x)  # the step's collectives: complete
    rec.interrupt(0, [1])
    try:
        rec.check_generation(epoch)
        return {"applied": True, "aborts": rec.abort_epoch() - epoch}
    except GenerationAborted as err:
        return {"applied": False, "error": str(err)}


def test_on_gloo_a_step_whose_collectives_returned_is_applied_after_an_abort():
    """gloo's collectives complete with every peer's data or raise: a step that read its scalars before
    the abort reached its rank is applied there, as on the ranks the word reached later (else the
    survivors recover one step apart, and what only the ranks behind held is lost to the live path)."""
    from ntp_nemo.launch.workers import run_workers

    [res] = run_workers(_gloo_step_after_an_abort, 1)
    assert res == {"applied": True, "aborts": 1}, res


def test_ctrl_c_between_restart_attempts_prints_the_resume_command(tmp_path):
    """Ctrl-C while no worker trains (the supervisor between two attempts) stops at once, and a run that
    has checkpoints says how to continue it."""
    import os
    import sys

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "checkpoints" / "step_000004" / "manifest.json").write_text("{}")  # an earlier attempt's
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the command's process, where the handler runs
        try:
            sys.stderr = os.fdopen(write, "w")  # where the handler prints (pytest captures the real one)
            job = OmegaConf.create({"runtime": {"output_dir": str(run)},
                                    "overrides": {"task": ["trainer.max_steps=8"]}})
            HydraConfig.get = staticmethod(lambda: job)  # the Hydra job of the command (in this fork only)
            from ntp_nemo.cli.train import _interrupted

            _interrupted([], signal.SIGINT, None)  # exits
        finally:
            os._exit(3)
    os.close(write)
    with os.fdopen(read) as fh:
        err = fh.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, err
    assert "nothing to save; stopped" in err
    assert f"to resume: ntp-train trainer.max_steps=8 hydra.run.dir={run}" in err, err
