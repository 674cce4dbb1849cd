"""The failure trace and the simulator's replay of it (`ntp_nemo.goodput.sim.replay`, used by
`bench/failure_trace.py`): the trace is seeded and deterministic, the replay of a small trace gives the
figures worked out by hand below for each recovery mode, the bench reads the files real runs wrote and
the replay predicts them; and the false step timeout the bench ran into (a run mid-step)."""

from __future__ import annotations

import json

import pytest

from ntp_nemo.goodput.sim.replay import (
    FULL,
    HANG,
    LOSE,
    REJOIN_LEAD,
    SLOW,
    FailureTrace,
    ReplayCosts,
    ReplayPolicy,
    TraceEvent,
    generate_trace,
    replay,
)
from tests.conftest import ROOT


def test_trace_is_seeded_and_has_the_four_events():
    a, b = generate_trace(3, 200), generate_trace(3, 200)
    assert a == b
    assert generate_trace(4, 200) != a
    assert [e.kind for e in a.events] == [LOSE, HANG, SLOW, LOSE]
    steps = [e.step for e in a.events]
    assert steps == sorted(steps) and 1 < steps[0] and steps[-1] <= 200
    first, hang, slow, late = a.events
    # Each loss strikes a full layout: the one before it is repaired (rejoin or checkpoint boundary) first.
    gap = a.repair_after_steps + 2 * a.checkpoint_every + REJOIN_LEAD
    assert hang.step - first.step >= gap and late.step - hang.step >= gap
    assert slow.step > hang.step + gap - 1 and slow.step + slow.steps < late.step
    # The late loss is never repaired: its rejoin would be announced past the last step.
    assert late.step + a.repair_after_steps + REJOIN_LEAD > a.steps
    assert all(0 <= e.rank < 4 for e in a.events)
    # The straggler is a slow device (`fault.factor`), long enough for the watch to name it (15 steps).
    assert slow.seconds == 0 and 0.4 <= slow.factor <= 0.6 and 25 <= slow.steps <= 40


def test_trace_writes_the_faults_ntp_train_reads():
    t = FailureTrace(40, 5, 4, (TraceEvent(LOSE, 6, 1), TraceEvent(SLOW, 9, 0, 0.5, 3),
                                TraceEvent(HANG, 20, 2)))
    assert t.fault_overrides() == [
        "fault=none",
        "++fault.more=[{kind:kill_rank,rank:1,step:6},{kind:slow,rank:0,step:9,seconds:0.5,steps:3},"
        "{kind:hang,rank:2,step:20}]",
        "fault.repair_after_steps=5",
        "checkpoint.every_n_steps=4",
    ]


def test_too_short_a_run_for_the_trace_is_refused():
    with pytest.raises(ValueError, match="at least"):
        generate_trace(1, 50)


# A 10-step run, checkpoints every 4, repairs after 3 steps: rank 1 lost at step 3, rank 0 slow by
# 0.5 s at steps 8 and 9.  Healthy steps take 1 s, steps on the shrunk layout 1.5 s.
TRACE = FailureTrace(10, 3, 4, (TraceEvent(LOSE, 3, 1), TraceEvent(SLOW, 8, 0, 0.5, 2)))
COSTS = ReplayCosts(step_s={FULL: 1.0, "(1,2)": 1.5}, startup_s=2.0, detect_s={LOSE: 0.5}, reshard_s=0.25,
                    rejoin_s=0.75, restart_s=4.0, repair_relaunch_s=3.0, stop_s=1.0, repair_wait_s=5.0)


def shrink(lost: frozenset[int]) -> str:
    return "(1,2)" if lost else FULL


def run(mode: str):
    return replay(TRACE, ReplayPolicy(mode, mode, shrink), COSTS)


def test_live_replay_by_hand():
    r = run("live")
    # Start 2; steps 1-2: 2; the loss: detect 0.5 + reshard 0.25, step 3 again on (1,2).  Recovered at step
    # 3, the repair is announced when step 3+3=6 starts and joins REJOIN_LEAD=3 steps later, at step 9:
    # steps 3-8 on (1,2) = 6 x 1.5 plus the straggler at step 8 (0.5); rejoin 0.75; step 9: 1 + 0.5 (slow);
    # step 10: 1.
    assert r.time_to_last_step_s == pytest.approx(2 + 2 + 0.75 + 9 + 0.5 + 0.75 + 1.5 + 1)
    assert (r.steps_executed, r.steps_redone, r.degraded_steps, r.repairs) == (10, 0, 6, 1)
    assert r.degraded_s == pytest.approx(9.5)
    assert r.layouts == {FULL: 4, "(1,2)": 6}


def test_restart_replay_by_hand():
    r = run("restart")
    # Steps 1-2: 2; the loss: detect 0.5 + relaunch 4 from the checkpoint of step 0 (none: the start), so
    # steps 1-2 are redone.  The degraded attempt stops at the first checkpoint boundary 3 steps after it
    # resumed (step 4): steps 1-4 on (1,2) = 6, relaunch on the repaired layout 3, steps 5-10: 6 + 1 slow.
    assert r.time_to_last_step_s == pytest.approx(2 + 2 + 4.5 + 6 + 3 + 7)
    assert (r.steps_executed, r.steps_redone, r.degraded_steps, r.repairs) == (12, 2, 4, 1)
    assert r.degraded_s == pytest.approx(6.0)


def test_spare_and_wait_replays_by_hand():
    spare = run("spare")
    # The loss: detect 0.5 + relaunch 4 on the full layout; steps 1-10 again: 10 + 1 slow.
    assert spare.time_to_last_step_s == pytest.approx(2 + 2 + 4.5 + 11)
    assert (spare.steps_redone, spare.degraded_steps, spare.repairs) == (2, 0, 0)
    wait = run("wait")
    # The loss: detect 0.5, the command stops 1, the repair 5, the command again to its first step 4.
    assert wait.time_to_last_step_s == pytest.approx(2 + 2 + 0.5 + 1 + 5 + 4 + 11)
    assert (wait.steps_redone, wait.degraded_steps, wait.repairs) == (2, 0, 1)


def test_a_repair_past_the_last_step_never_lands():
    late = FailureTrace(10, 3, 4, (TraceEvent(LOSE, 7, 1),))
    r = replay(late, ReplayPolicy("live", "live", shrink), COSTS)
    # Announced at step 10, it would join at step 13: the run ends on (1,2) (steps 7-10).
    assert (r.repairs, r.degraded_steps) == (0, 4)
    restart = replay(late, ReplayPolicy("restart", "restart", shrink), COSTS)
    # Relaunched from the checkpoint of step 4 (steps 5-6 redone); a repair at step 8 would land
    # before the end: it does (4 + 3, rounded up to the boundary 8 < 10).
    assert (restart.steps_redone, restart.repairs, restart.degraded_steps) == (2, 1, 4)


# ---- the bench's reading of real runs -----------------------------------------------------------------
# Files two real `ntp-train` runs wrote (bench/failure_trace.py --steps 60 --repair-after 6 --every 3, seed
# 1; the layout (2,2) of the tiny model): NTP-PW (live) and NTP by restart.  The command's start is taken
# at the first `job_start` (these runs predate the bench's record of it).
FIXTURES = ROOT / "tests" / "fixtures" / "failure_trace"
SMOKE = FailureTrace(60, 6, 3, (TraceEvent(LOSE, 6, 3), TraceEvent(HANG, 23, 3),
                                TraceEvent(SLOW, 47, 3, 0.5, 4), TraceEvent(LOSE, 58, 0)))


def _bench(monkeypatch):
    from bench import failure_trace

    return failure_trace


def _measured(ft, name: str):
    doc = json.loads((FIXTURES / f"{name}.commands.json").read_text())
    run = ft.Run(name, FIXTURES / name, [ft.Command(**c) for c in doc["commands"]], doc["repair_wait_s"])
    m = ft.measure(run, SMOKE, None, "(2,2)")
    _, mode, rule = ft.POLICIES[name]
    return m, replay(SMOKE, ReplayPolicy(name, mode, ft.shrink(rule)), m.costs)


def test_bench_reads_a_restart_run_and_the_replay_predicts_it(monkeypatch):
    ft = _bench(monkeypatch)
    m, p = _measured(ft, "ntp-restart")
    # Three failures, each a relaunch: the hang seen by the 4 s heartbeat, the kills within a second.
    assert m.failures == 3 and m.fallbacks == 0
    assert 4.0 <= m.costs.detect_s[HANG] < 8.0 and m.costs.detect_s[LOSE] < 1.0
    assert m.costs.restart_s > 0 and m.costs.repair_relaunch_s > 0 and m.costs.commit_s > 0
    assert set(m.costs.step_s) == {FULL, "(2,1)", "(1,2)"}
    # Steps redone: 4-5 after the loss at 6 (checkpoint 3), 22 after the hang at 23 (checkpoint 21), and
    # 55-57 after the loss at 58: the save of step 57 was still committing when rank 0 died, so the
    # relaunch resumed from step 54.  The replay counts the same.
    assert m.steps_redone == 6 == p.steps_redone
    assert m.repairs == 2 == p.repairs
    assert abs(p.time_to_last_step_s / m.time_to_last_step_s - 1) <= 0.10


def test_bench_reads_a_live_run_and_the_replay_predicts_it(monkeypatch):
    ft = _bench(monkeypatch)
    m, p = _measured(ft, "ntp-pw")
    assert m.failures == 3 and m.fallbacks == 0 and m.steps_redone == 0 == p.steps_redone
    assert m.costs.reshard_s > 0 and m.costs.rejoin_s > 0
    # Degraded after the loss at 6 until the rejoin at 15, after the hang at 23 until 32, after 58 to the end.
    assert m.degraded_steps == 21 == p.degraded_steps and m.repairs == 2 == p.repairs
    assert m.batch_kept
    assert abs(p.time_to_last_step_s / m.time_to_last_step_s - 1) <= 0.10


# ---- the step timeout over a long run (found by this bench) -------------------------------------------
def test_a_run_in_the_middle_of_a_step_is_no_step_timeout(tmp_path):
    """A rank's heartbeat says `step_start` for the whole of each step, so a monitor polling during a step
    saw no completed step at all and, once the run had lasted `fault.step_timeout_s`, stopped a healthy
    run.  The beats carry the end of the last completed step; a real stall is still caught."""
    from types import SimpleNamespace

    from ntp_nemo.resilience.beats import read_beats
    from ntp_nemo.resilience.detection import step_verdict
    from ntp_nemo.resilience.fault_config import Timeouts
    from ntp_nemo.resilience.heartbeat import Heartbeat

    for rank in (0, 1):
        hb = Heartbeat(tmp_path)
        hb.on_train_batch_start(SimpleNamespace(global_rank=rank, global_step=0), None, None, 0)
        hb.on_train_batch_end(SimpleNamespace(global_rank=rank, global_step=1), None, None, None, 0)
        hb.on_train_batch_start(SimpleNamespace(global_rank=rank, global_step=1), None, None, 1)
    beats = read_beats(tmp_path, 2)
    assert {b.phase for b in beats.values()} == {"step_start"}
    done = max(b.done_t for b in beats.values())
    timeouts = Timeouts(1.0, 2.0, 8.0)
    # The run started 100 s ago; its last step ended a moment ago: no verdict.
    assert step_verdict(beats, 2, done - 100.0, done + 0.5, timeouts) is None
    stalled = step_verdict(beats, 2, done - 100.0, done + 9.0, timeouts)
    assert stalled is not None and stalled.reason == "step timeout" and "9.0s" in stalled.detail
