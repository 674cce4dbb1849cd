"""Failover through the real CLI: a lost rank is detected, the layout re-planned, training resumed from
the latest checkpoint on the new layout, and the loss curve is the failure-free one.

All runs start on NTP (2,1) (ranks 0,1 = replica 0; rank 2 = replica 1), 12 steps, checkpoints every 3.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter

import pytest

from ntp_nemo.goodput import compute_goodput, load_events
from tests.conftest import TINY, read_metrics, run_cli, sweep_cases

BASE = [
    *TINY,
    "mesh.dp=2",
    "mesh.tp=2",
    "ntp.replica_tp=[2,1]",
    "trainer.max_steps=12",
    "checkpoint.every_n_steps=3",
    "fault.recovery=restart",  # the restart path (tests/resilience/test_live_failover_cli.py: live)
]
STEPS = list(range(1, 13))
FAST_TIMEOUTS = ["fault.heartbeat_timeout_s=4", "fault.collective_timeout_s=8", "fault.step_timeout_s=60"]


def last_losses(run):
    """Loss of the last execution of each step (a redone step overwrites the earlier one)."""
    return {m["step"]: m["loss"] for m in read_metrics(run)}


def attempts(run):
    return [json.loads(line) for line in (run / "failover" / "attempts.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(reference_losses):
    """Losses of the failure-free run of BASE (conftest's one-process run of TINY, 12 steps: every layout
    follows it, (2,1) included)."""
    return reference_losses("single-12")


def assert_same_curve(run, reference):
    got = last_losses(run)
    assert sorted(got) == STEPS  # every step finished
    for step, ref in reference.items():
        assert abs(got[step] - ref) <= 1e-4 * abs(ref), (step, got[step], ref)


def assert_goodput_consistent(run, failures):
    """The goodput report agrees with the events and the metrics: failures, redone steps, wasted progress
    and recovery downtime (bounded by the failure -> next completed step spans)."""
    events = load_events(run)
    rep = compute_goodput(events)
    redone = sum(n - 1 for n in Counter(m["step"] for m in read_metrics(run)).values())
    assert rep.failures == failures
    assert rep.steps_completed == 12 and rep.steps_redone == redone
    assert rep.badput_s["wasted_progress"] > 0  # at least the step each failure cut short
    detected = [e["t"] for e in events if e["event"] == "failure_detected"]
    assert len(detected) == failures
    ends = sorted(e["t"] for e in events if e["event"] == "step_end")
    windows = [min(t for t in ends if t > f) - f for f in detected]
    assert 0 < rep.badput_s["recovery_downtime"] <= sum(windows) + 1e-6
    assert abs(rep.productive_s + sum(rep.badput_s.values()) - rep.total_s) < 1e-6
    recovered = [e for e in events if e["event"] == "recovery_done"]
    assert len(recovered) == failures
    return rep


POLICIES = {"ntp": "(1,1)", "dp_drop": "(1)", "restart": "(2,1)"}
# Every run with a fault that recovers: one `ntp-train -m` sweep, a run directory per case (its console
# in that directory's train.log; the sweep's stdout is the console of all of them).
FAULTS = {
    # Synchronous saves: the resume point (step 3) is fixed whatever the load (an asynchronous save of step
    # 3 still writing when step 6 starts, on a loaded machine, would resume from step 0).
    **{f"kill-{policy}": ["fault=kill_rank", "fault.rank=1", "fault.step=6", f"fault.policy={policy}",
                          "checkpoint.async_save=false"]
       for policy in POLICIES},
    "hang": ["fault=hang", "fault.rank=2", "fault.step=5", *FAST_TIMEOUTS],
    # Synchronous saves: each kill then follows a committed checkpoint, so the boundaries are fixed (an
    # asynchronous save still in flight when a rank dies is lost, and the attempt resumes further back).
    "two-failures": ["fault=two_failures", "fault.repair_after_steps=3", "checkpoint.async_save=false"],
    "kill-during-save": ["fault=kill_during_save", "fault.rank=1", "fault.step=6"],
    "corrupt": ["fault=corrupt_checkpoint"],
    "straggler": ["fault=slow", "fault.rank=2", "fault.step=3", "fault.steps=2", "fault.seconds=1.5"],
}


@pytest.fixture(scope="module")
def fault_runs(tmp_path_factory):
    return sweep_cases(FAULTS, BASE, tmp_path_factory.mktemp("faults"))


def run_with_faults(fault_runs, case):
    """The run directory of FAULTS[case] and its console (train.log), the sweep having succeeded."""
    proc = fault_runs.proc
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = fault_runs.run_dir(case)
    return run, (run / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(POLICIES))
def test_kill_rank_recovers_on_the_planned_layout(fault_runs, reference, policy):
    after = POLICIES[policy]
    run, log = run_with_faults(fault_runs, f"kill-{policy}")
    assert_same_curve(run, reference)
    layouts = [(m["step"], m["layout"]) for m in read_metrics(run)]
    assert layouts[0] == (1, "(2,1)") and layouts[-1] == (12, after)
    assert {lay for step, lay in layouts if step < 4} == {"(2,1)"}
    tries = attempts(run)
    assert [a["outcome"] for a in tries] == ["failed", "ok"]
    assert tries[0]["failure"]["ranks"] == [1] and tries[0]["failure"]["reason"] == "exit status"
    assert tries[1]["resume"].endswith("step_000003")  # steps 4 and 5 redone, 6 was cut short
    # Said on the console (the sweep's stdout), by this job (its train.log).
    assert f"-> {after}" in fault_runs.proc.stdout and f"-> {after}" in log
    rep = assert_goodput_consistent(run, failures=1)
    assert rep.steps_redone == 2
    assert set(rep.productive_by_layout) == {"(2,1)", after}


@pytest.mark.slow
def test_hang_is_caught_by_heartbeats_and_recovered(fault_runs, reference):
    run, _ = run_with_faults(fault_runs, "hang")
    assert_same_curve(run, reference)
    failure = attempts(run)[0]["failure"]
    assert failure["reason"] == "heartbeat" and failure["ranks"] == [2]
    assert read_metrics(run)[-1]["layout"] == "(2)"  # replica 1 lost its only rank: dropped
    assert_goodput_consistent(run, failures=1)


@pytest.mark.slow
def test_two_failures_each_followed_by_repair(fault_runs, reference):
    """Rank 1 dies at step 4 and rank 0 (of the repaired layout) at step 8; after 3 steps on (1,1) the lost
    GPU is back and the run returns to (2,1) at the next checkpoint boundary."""
    run, _ = run_with_faults(fault_runs, "two-failures")
    assert_same_curve(run, reference)
    tries = attempts(run)
    assert [(a["layout"], a["outcome"]) for a in tries] == [
        ("(2,1)", "failed"),
        ("(1,1)", "repair_stop"),
        ("(2,1)", "failed"),
        ("(1,1)", "repair_stop"),
        ("(2,1)", "ok"),
    ]
    assert [a["stop_at_step"] for a in tries] == [None, 6, None, 9, None]
    by_step = last_losses(run)
    layouts = {m["step"]: m["layout"] for m in read_metrics(run)}
    assert [layouts[s] for s in STEPS] == ["(2,1)"] * 3 + ["(1,1)"] * 3 + ["(1,1)"] * 3 + ["(2,1)"] * 3
    assert len(by_step) == 12
    assert_goodput_consistent(run, failures=2)


@pytest.mark.slow
def test_kill_during_save_resumes_from_the_previous_checkpoint(fault_runs, reference):
    run, _ = run_with_faults(fault_runs, "kill-during-save")
    assert_same_curve(run, reference)
    tries = attempts(run)
    assert tries[0]["failure"]["ranks"] == [1]
    assert tries[1]["resume"].endswith("step_000003")  # the save of step 6 never committed
    rep = assert_goodput_consistent(run, failures=1)
    assert rep.steps_redone == 3


@pytest.mark.slow
def test_corrupt_checkpoint_is_skipped_on_recovery(fault_runs, reference):
    run, log = run_with_faults(fault_runs, "corrupt")
    assert_same_curve(run, reference)
    # The console (the sweep's stdout; this job's train.log) names the checkpoint used and the one it
    # replaced; the warning (stderr) why.
    ckpts = run / "checkpoints"
    announced = (f"resuming from {ckpts / 'step_000003'} (step 3; data checked as it loaded; instead of "
                 f"{ckpts / 'step_000006'}, whose data failed its check)")
    assert announced in fault_runs.proc.stdout and announced in log, log[-3000:]
    skipped = f"warning: skipping checkpoint {ckpts / 'step_000006'}: file "
    assert skipped in fault_runs.proc.stderr and skipped in log
    assert "corrupted); using " in log.split(skipped, 1)[1].splitlines()[0]
    # The pre-launch check reads no data: the workers find the flipped byte and fall back together.
    assert attempts(run)[1]["resume"].endswith("step_000006")
    rep = assert_goodput_consistent(run, failures=1)
    assert rep.steps_redone == 4  # steps 4..7 again


@pytest.mark.slow
def test_failures_beyond_max_restarts_exit_1(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(
        [
            *BASE,
            "fault=kill_rank",
            "fault.rank=1",
            "fault.step=3",
            "fault.max_restarts=0",
            f"hydra.run.dir={run}",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert "fault.max_restarts" in proc.stderr


@pytest.mark.slow
def test_straggler_slows_the_job_without_failing_it(fault_runs, reference):
    run, _ = run_with_faults(fault_runs, "straggler")
    assert_same_curve(run, reference)
    times = {m["step"]: m["step_time_s"] for m in read_metrics(run)}
    assert len(read_metrics(run)) == 12  # nothing redone
    assert min(times[3], times[4]) >= 1.5 > statistics.median(times[s] for s in STEPS if s not in (3, 4))
    assert [a["outcome"] for a in attempts(run)] == ["ok"]
