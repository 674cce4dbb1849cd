"""Hot spares (`fault.spares`, `ntp_nemo/resilience/spares.py`): a live run whose lost process is replaced
by a waiting spare, the pool's lifecycle on its own (a spare that dies or never gets ready is replaced,
never handed out; every spare is reaped at close), and the config errors."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import torch.multiprocessing as mp

from ntp_nemo.errors import ConfigError
from ntp_nemo.resilience.fault_config import LaunchContext, validate_fault_config
from ntp_nemo.resilience.spares import GIVE_UP_AFTER, SparePool, spare_body
from tests.conftest import TINY, sweep_cases

COMMON = [*TINY, "trainer.max_steps=8", "checkpoint.every_n_steps=0", "checkpoint.save_on_end=false",
          "fault=kill_rank", "fault.spares=1"]
BASE = ["mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]"]
# Rank 3 killed at step 2 with one hot spare and no fault.repair_after_steps: the spare takes its place.
# Then (the second job of the sweep: a rejoin runs first, see test_live_failover_cli's LIVE) one replica
# of TP 2 loses rank 1: no survivor holds its shards, the live path falls back to the restart path, and
# the spares of that attempt are released, none taken.
CASES = {"spare": [*BASE, "fault.rank=3", "fault.step=2"],
         "fallback": ["mesh.dp=1", "mesh.tp=2", "ntp.replica_tp=[2]", "fault.rank=1", "fault.step=3",
                      "fault.recovery=live"]}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def spare_runs(tmp_path_factory):
    """CASES, as the jobs of one sweep."""
    return sweep_cases(CASES, COMMON, tmp_path_factory.mktemp("spares"))


def _job(runs, name):
    assert runs.proc.returncode == 0, runs.proc.stdout[-2000:] + runs.proc.stderr[-3000:]
    run = runs.run_dir(name)
    events = [json.loads(line) for line in (run / "goodput.jsonl").read_text().splitlines() if line.strip()]
    return run, (run / "train.log").read_text(), events


def test_a_spare_replaces_the_lost_process_and_the_pool_refills(spare_runs, reference_losses):
    run, log, events = _job(spare_runs, "spare")
    # the failure-free curve over every step (the survivors' reshard, then the spare's rejoin)
    got = {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "loss" in m}
    ref = reference_losses("single-8")
    assert sorted(got) == list(range(1, 9))
    for step, want in ref.items():
        assert abs(got[step] - want) <= 1e-4 * abs(want), (step, got[step], want)
    assert "failover | spares: spare 0 takes the place of process 3" in log
    assert "spare 1 starts in its place" in log
    assert "failover | spares: spare 1 ready" in log  # the pool refilled in the background
    assert "repaired process(es) rejoined: layout (2,1) -> (2,2)" in log
    spares = [(e["action"], e["spare"]) for e in events if e["event"] == "spare"]
    assert spares == [("ready", 0), ("taken", 0), ("ready", 1)], spares
    taken = next(e for e in events if e["event"] == "spare" and e["action"] == "taken")
    assert taken["process"] == 3
    # the spare that took the place trained: the rejoin's state reached it (its steps on the full layout)
    assert any(e["event"] == "recovery_done" and e.get("rejoin") for e in events)
    # nothing left behind: the spare still waiting at the end was released
    pids = {e["spare_pid"] for e in events if e["event"] == "spare"}
    assert len(pids) == 2 and not any(_alive(p) for p in pids), pids


def test_spares_are_released_when_the_live_path_falls_back_to_restart(spare_runs, reference_losses):
    run, log, events = _job(spare_runs, "fallback")
    assert "falling back to the restart path" in log
    assert "failover | spares: spare 0 ready" in log
    assert "takes the place" not in log  # no rejoin was announced while the survivors were giving up
    got = {m["step"]: m["loss"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
           if "loss" in m}
    ref = reference_losses("single-8")
    for step, want in ref.items():  # the restart from the start, on layout (1)
        assert abs(got[step] - want) <= 1e-4 * abs(want), (step, got[step], want)
    pids = {e["spare_pid"] for e in events if e["event"] == "spare"}
    assert pids and not any(_alive(p) for p in pids), pids


# -- the pool on its own (forked spares whose work is an exit status) -------------------------------------
def _pool(size: int, warm, ready_timeout_s: float = 30.0,
          me: int | None = None) -> tuple[SparePool, list[str]]:
    """`me`: the pid the spares take for their launching process (default: this one)."""
    lines: list[str] = []
    ctx = mp.get_context("fork")
    me = os.getpid() if me is None else me

    def start_one(number, child, parent):
        proc = ctx.Process(target=spare_body, args=(child, parent, warm, lambda code: os._exit(code), me))
        proc.start()
        return proc

    return SparePool(size, start_one, ready_timeout_s=ready_timeout_s, grace_s=2.0, say=lines.append), lines


def _until(cond, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("not within the bound")


def test_a_spare_that_dies_while_waiting_is_replaced_not_used():
    pool, lines = _pool(1, lambda: None)
    try:
        pool.start()
        first = _until(pool.ready)[0]
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.join(5)
        assert pool.take() is None  # the dead one is never handed out
        assert any("spare 0 died while waiting" in ln for ln in lines), lines
        second = _until(pool.ready)[0]
        assert second.number == 1
        taken = pool.take()
        assert taken is second and taken.successor == 2
        pool.assign(taken, 7, idx=3)  # its work: exit with status 7
        taken.proc.join(5)
        assert taken.proc.exitcode == 7
        late = _until(pool.ready)[0]  # the refilled spare, dead as it is taken: assign says so
        assert pool.take() is late
        os.kill(late.proc.pid, signal.SIGKILL)
        late.proc.join(5)
        assert pool.assign(late, 0, idx=1) is False
        assert "spare 2 died as it was taken for process 1" in lines[-1]
        _until(pool.ready)  # the one started in its place
    finally:
        waiting = list(pool.waiting)
        pool.close()
    assert waiting and all(s.proc.exitcode == 0 for s in waiting)  # released: exited on its own
    assert pool.take() is None and not pool.waiting  # nothing starts after close


def test_a_spare_not_ready_in_time_is_stopped_and_the_pool_gives_up():
    pool, lines = _pool(1, lambda: time.sleep(60), ready_timeout_s=0.3)
    try:
        pool.start()
        started = [pool.waiting[0].proc]
        _until(lambda: (pool.poll(), not pool.waiting)[1], timeout_s=10.0)
        assert sum("not ready 0.3 s after its start" in ln for ln in lines) == GIVE_UP_AFTER
        assert "no more are started" in lines[-1]
        assert all(p.exitcode is not None for p in started)
    finally:
        pool.close()


def test_a_spare_whose_launcher_is_gone_exits_by_itself():
    pool, _ = _pool(1, lambda: None, me=-1)  # its launching process is "gone" from the start
    try:
        pool.start()
        spare = pool.waiting[0]
        spare.proc.join(5)  # it said it was ready, then saw its launcher gone within one POLL_S
        assert spare.proc.exitcode == 0
    finally:
        pool.close()


# -- the config ------------------------------------------------------------------------------------------
def _spec(*overrides):
    from ntp_nemo.config.failover import failover_spec
    from tests.conftest import compose

    return failover_spec(compose([*TINY, *BASE, *overrides]))


@pytest.mark.parametrize("overrides,context,says", [
    (["fault.spares=-1"], LaunchContext(), "must be >= 0"),
    (["fault.spares=1", "fault.recovery=restart"], LaunchContext(), "use fault.recovery=live"),
    (["fault.spares=1"], LaunchContext("slurm", coordinator=True), "set fault.spares=0"),
    (["fault.spares=1"], LaunchContext("torchrun"), "recovers by restart"),
])
def test_bad_spares_are_config_errors(overrides, context, says):
    with pytest.raises(ConfigError) as err:
        validate_fault_config(_spec(*overrides), context)
    assert err.value.key == "fault.spares" and says in str(err.value)


def test_spares_must_be_a_whole_number():
    spec = _spec("fault.spares=1")
    validate_fault_config(spec, LaunchContext())  # accepted under ntp-train's own launcher
    bad = dataclasses.replace(spec, fault=dataclasses.replace(spec.fault, spares=1.5))
    with pytest.raises(ConfigError, match="whole number") as err:
        validate_fault_config(bad, LaunchContext())
    assert err.value.key == "fault.spares"
