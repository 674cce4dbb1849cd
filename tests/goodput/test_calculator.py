"""Goodput calculator on synthetic event streams with known answers."""

from __future__ import annotations

import random

import pytest

from ntp_nemo.goodput import BADPUT_CATEGORIES, build_timeline, compute_goodput, summary_line
from ntp_nemo.goodput import events as ev


class Stream:
    """Builds an event stream with explicit times, the way the recorder would write it."""

    def __init__(self) -> None:
        self.events: list[dict] = []

    def add(self, t: float, event: str, **fields) -> Stream:
        self.events.append({"t": t, "event": event, "pid": 1, **fields})
        return self

    def steps(self, first: int, start: float, duration: float, count: int, **fields) -> float:
        """`count` back-to-back steps from `first`; returns the end time."""
        t = start
        for step in range(first, first + count):
            self.add(t, ev.STEP_START, step=step)
            t += duration
            self.add(
                t, ev.STEP_END, step=step, **{"layout": "tp4x2", "capacity": 1.0, "tokens": 64, **fields}
            )
        return t


def assert_partition(report) -> None:
    """Productive time plus every badput category is exactly the job time."""
    assert set(report.badput_s) == set(BADPUT_CATEGORIES)
    assert all(v >= 0 for v in report.badput_s.values())
    assert report.productive_s + sum(report.badput_s.values()) == pytest.approx(report.total_s, abs=1e-9)
    assert 0.0 <= report.goodput <= 1.0


def test_clean_run_with_checkpoint() -> None:
    s = Stream().add(0.0, ev.JOB_START).add(2.0, ev.INIT_DONE)
    t = s.steps(1, start=2.0, duration=1.0, count=5)
    s.add(t, ev.CKPT_SAVE_START, step=5).add(t + 0.5, ev.CKPT_SAVE_END, step=5)
    s.add(t + 1.0, ev.JOB_END, status="ok")

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.total_s == pytest.approx(8.0)
    assert r.productive_s == pytest.approx(5.0)
    assert r.goodput == pytest.approx(5.0 / 8.0)
    assert r.badput_s[ev.INITIALIZATION] == pytest.approx(2.0)
    assert r.badput_s[ev.CHECKPOINT_SAVE] == pytest.approx(0.5)
    assert r.badput_s[ev.OTHER] == pytest.approx(0.5)  # save end -> job end
    assert (r.steps_completed, r.steps_redone, r.failures, r.lifetimes) == (5, 0, 0, 1)
    assert r.capacity_fraction == pytest.approx(1.0)
    assert r.productive_by_layout == {"tp4x2": pytest.approx(5.0)}


def _crash_and_restart(explicit_failure_at: float | None) -> Stream:
    """Lifetime 1 saves after step 2, runs steps 3-4, dies in step 5; lifetime 2 restores step 2."""
    s = Stream().add(0.0, ev.JOB_START).add(1.0, ev.INIT_DONE)
    t = s.steps(1, start=1.0, duration=1.0, count=2)  # steps 1, 2: 1 -> 3
    s.add(t, ev.CKPT_SAVE_START, step=2).add(t + 0.2, ev.CKPT_SAVE_END, step=2)
    t = s.steps(3, start=3.2, duration=1.0, count=2)  # steps 3, 4: 3.2 -> 5.2 (to be redone)
    s.add(t, ev.STEP_START, step=5)  # the process dies here
    if explicit_failure_at is not None:
        s.add(explicit_failure_at, ev.FAILURE_DETECTED, rank=0, reason="exit code -9")
    s.add(10.0, ev.JOB_START).add(11.0, ev.INIT_DONE)
    s.add(11.0, ev.CKPT_RESTORE_START).add(12.0, ev.CKPT_RESTORE_END, step=2)
    t = s.steps(3, start=12.0, duration=1.0, count=4)  # steps 3-6: 12 -> 16
    s.add(t, ev.JOB_END, status="ok")
    return s


def test_restart_redoes_steps_from_older_checkpoint() -> None:
    r = compute_goodput(_crash_and_restart(explicit_failure_at=None).events)
    assert_partition(r)
    assert r.total_s == pytest.approx(16.0)
    assert r.lifetimes == 2
    assert r.steps_completed == 6
    assert r.steps_redone == 2  # steps 3 and 4 ran twice
    assert r.failures == 1  # implicit: lifetime 1 stopped in mid-training without job_end
    assert r.productive_s == pytest.approx(6.0)  # steps 1, 2 once; 3-6 in their last execution
    assert r.badput_s[ev.WASTED_PROGRESS] == pytest.approx(2.0)  # the discarded runs of steps 3, 4
    assert r.badput_s[ev.INITIALIZATION] == pytest.approx(2.0)
    assert r.badput_s[ev.CHECKPOINT_RESTORE] == pytest.approx(1.0)
    assert r.badput_s[ev.CHECKPOINT_SAVE] == pytest.approx(0.2)
    # Failure at the last event (5.2) to the first step end after it (13), less init, restore, step 3.
    assert r.badput_s[ev.RECOVERY_DOWNTIME] == pytest.approx(13.0 - 5.2 - 1.0 - 1.0 - 1.0)
    assert r.badput_s[ev.OTHER] == pytest.approx(0.0, abs=1e-9)


def test_failure_detected_by_supervisor() -> None:
    tl = build_timeline(_crash_and_restart(explicit_failure_at=7.0).events)
    assert [(f.t, f.rank, f.implicit) for f in tl.failures] == [(7.0, 0, False)]
    interrupted = [run for run in tl.steps if not run.completed]
    assert [(run.step, run.start, run.end) for run in interrupted] == [(5, 5.2, 7.0)]

    r = compute_goodput(_crash_and_restart(explicit_failure_at=7.0).events)
    assert_partition(r)
    assert r.failures == 1
    # Step 5 ran until the failure was detected: that partial execution is wasted too.
    assert r.badput_s[ev.WASTED_PROGRESS] == pytest.approx(2.0 + (7.0 - 5.2))
    assert r.badput_s[ev.RECOVERY_DOWNTIME] == pytest.approx(13.0 - 7.0 - 3.0)


def test_degraded_capacity_after_in_process_recovery() -> None:
    s = Stream().add(0.0, ev.JOB_START).add(1.0, ev.INIT_DONE)
    t = s.steps(1, start=1.0, duration=2.0, count=4)  # healthy: 1 -> 9
    s.add(t, ev.STEP_START, step=5)
    s.add(9.5, ev.FAILURE_DETECTED, rank=3, reason="heartbeat timeout")
    s.add(10.5, ev.RECOVERY_DONE, layout="tp4+tp3")
    t = s.steps(5, start=10.5, duration=1.0, count=4, layout="tp4+tp3", capacity=7 / 8)  # 10.5 -> 14.5
    s.add(t, ev.JOB_END, status="ok")

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.total_s == pytest.approx(14.5)
    # 4 s of steps at capacity 7/8: 3.5 s of progress, 0.5 s of degraded throughput.
    assert r.productive_s == pytest.approx(11.5)
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(0.5)
    assert r.capacity_fraction == pytest.approx((8.0 * 1.0 + 4.0 * 7 / 8) / 12.0)
    assert r.progress_goodput == pytest.approx(12.0 / 14.5)
    assert r.productive_by_layout == {"tp4x2": pytest.approx(8.0), "tp4+tp3": pytest.approx(3.5)}
    assert r.badput_s[ev.WASTED_PROGRESS] == pytest.approx(0.5)  # step 5 until the failure
    assert r.badput_s[ev.RECOVERY_DOWNTIME] == pytest.approx(1.0)  # failure -> restart of step 5
    assert (r.steps_completed, r.steps_redone, r.failures) == (8, 0, 1)
    assert f"NTP capacity {r.capacity_fraction:.3f}" in summary_line(r)


def test_step_recovered_live_inside_its_own_execution() -> None:
    # The live path's event order: the step never restarts (no second step_start); the failure and the
    # recovery fall inside it and the same execution ends once the step was redone on the new layout.
    s = Stream().add(0.0, ev.JOB_START).add(1.0, ev.INIT_DONE)
    t = s.steps(1, start=1.0, duration=2.0, count=4)  # 1 -> 9
    s.add(t, ev.STEP_START, step=5)
    s.add(9.5, ev.FAILURE_DETECTED, rank=3, reason="collective error")
    s.add(10.5, ev.RECOVERY_DONE, layout="(2,1)", mode="live")
    s.add(11.5, ev.STEP_END, step=5, layout="(2,1)", capacity=0.75, tokens=64)
    t = s.steps(6, start=11.5, duration=1.0, count=2, layout="(2,1)", capacity=0.75)  # -> 13.5
    s.add(t, ev.JOB_END, status="ok")

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.badput_s[ev.WASTED_PROGRESS] == pytest.approx(0.5)  # step 5 before the failure
    assert r.badput_s[ev.RECOVERY_DOWNTIME] == pytest.approx(1.0)  # detection -> recovery_done
    # The redone step counts from recovery_done; 3 s at capacity 0.75 (0.75 s of degraded throughput).
    assert r.productive_s == pytest.approx(8.0 + 0.75 * (1.0 + 2.0))
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(0.25 * 3.0)
    assert (r.steps_completed, r.steps_redone, r.failures) == (7, 0, 1)
    assert r.failure_recoveries == [{"mode": "live", "recovery_s": pytest.approx(2.0), "rank": 3,
                                     "process": None, "reason": "collective error", "t": 9.5}]


def test_checkpoint_blocking_part_and_save_inside_step() -> None:
    s = Stream().add(0.0, ev.JOB_START).add(0.0, ev.INIT_DONE)
    s.steps(1, start=0.0, duration=1.0, count=1)
    # Asynchronous save: blocks 0.3 s, finishes in the background during step 2.
    s.add(1.0, ev.CKPT_SAVE_START, step=1)
    s.add(1.3, ev.STEP_START, step=2)
    s.add(1.8, ev.CKPT_SAVE_END, step=1, blocking_s=0.3)
    s.add(2.3, ev.STEP_END, step=2, layout="tp4x2", capacity=1.0, tokens=64)
    # Synchronous save issued from inside step 3: its 0.2 s are not productive.
    s.add(2.3, ev.STEP_START, step=3)
    s.add(2.5, ev.CKPT_SAVE_START, step=3).add(2.7, ev.CKPT_SAVE_END, step=3)
    s.add(3.3, ev.STEP_END, step=3, layout="tp4x2", capacity=1.0, tokens=64)
    s.add(3.3, ev.JOB_END, status="ok")

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.badput_s[ev.CHECKPOINT_SAVE] == pytest.approx(0.3 + 0.2)
    assert r.productive_s == pytest.approx(3.3 - 0.5)


def test_save_interrupted_by_crash_counts_until_the_crash() -> None:
    s = Stream().add(0.0, ev.JOB_START).add(0.0, ev.INIT_DONE)
    t = s.steps(1, start=0.0, duration=1.0, count=2)
    s.add(t, ev.CKPT_SAVE_START, step=2).add(t + 0.4, ev.STEP_START, step=3)  # no save end: killed
    tl = build_timeline(s.events)
    assert [(x.start, x.end) for x in tl.saves] == [(2.0, 2.4)]


def test_save_of_a_lost_rank_0_ends_at_the_failure_and_aborts_close_saves() -> None:
    # Process 0 (rank 0, the goodput writer) starts a save and is killed in it; process 1 becomes rank 0,
    # records the failure (live) and goes on writing steps: the save is charged up to the failure only.
    s = Stream().add(0.0, ev.JOB_START).add(1.0, ev.INIT_DONE)
    t = s.steps(1, start=1.0, duration=1.0, count=5)  # -> 6
    s.add(t, ev.CKPT_SAVE_START, step=5)
    s.events[-1]["pid"] = 100
    s.add(6.3, ev.FAILURE_DETECTED, rank=0, process=0, reason="collective error")
    s.add(7.0, ev.RECOVERY_DONE, layout="(1,2)", mode="live")
    t = s.steps(6, start=7.0, duration=1.0, count=10, layout="(1,2)", capacity=0.75)  # -> 17
    # A later save the new rank 0 aborts (a full disk), an asynchronous one that commits in the background.
    s.add(t, ev.CKPT_SAVE_START, step=15).add(t + 0.2, ev.CKPT_SAVE_ABORT, step=15, reason="OSError")
    s.add(t + 0.2, ev.CKPT_SAVE_START, step=15).add(t + 0.3, ev.CKPT_SAVE_END, step=15, blocking_s=0.1)
    s.add(t + 0.3, ev.STEP_START, step=16)
    s.add(t + 2.0, ev.CKPT_COMMIT, step=15, ok=True)
    s.add(t + 1.3, ev.STEP_END, step=16, layout="(1,2)", capacity=0.75, tokens=64)
    s.add(t + 2.0, ev.JOB_END, status="ok")

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.badput_s[ev.CHECKPOINT_SAVE] == pytest.approx(0.3 + 0.2 + 0.1)
    assert r.productive_s == pytest.approx(5.0 + 0.75 * (10.0 + 1.0))  # (1,2) runs at capacity 0.75
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(0.25 * (10.0 + 1.0))
    assert r.failure_recoveries == [{"mode": "live", "recovery_s": pytest.approx(8.0 - 6.3), "rank": 0,
                                     "process": 0, "reason": "collective error", "t": 6.3}]


def test_clean_end_then_rerun_excludes_idle_gap() -> None:
    s = Stream().add(0.0, ev.JOB_START).add(1.0, ev.INIT_DONE)
    t = s.steps(1, start=1.0, duration=1.0, count=3)
    s.add(t, ev.JOB_END, status="ok")
    s.add(1000.0, ev.JOB_START).add(1001.0, ev.INIT_DONE)
    t = s.steps(4, start=1001.0, duration=1.0, count=2)
    s.add(t, ev.JOB_END, status="ok")

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.idle_s == pytest.approx(1000.0 - 4.0)
    assert r.total_s == pytest.approx(4.0 + 3.0)
    assert r.failures == 0  # a clean end is not a failure
    assert r.goodput == pytest.approx(5.0 / 7.0)


def test_data_wait_and_events_out_of_order() -> None:
    s = Stream().add(0.0, ev.JOB_START).add(0.5, ev.INIT_DONE)
    t = s.steps(1, start=1.0, duration=1.0, count=2)
    s.add(t, ev.JOB_END, status="ok")
    s.add(0.99, ev.DATA_WAIT, seconds=0.49)  # appended late by another writer: waited 0.5 -> 0.99

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.badput_s[ev.DATA_LOADING] == pytest.approx(0.49)
    assert r.badput_s[ev.OTHER] == pytest.approx(0.01)
    assert r.badput_s[ev.INITIALIZATION] == pytest.approx(0.5)
    assert r.productive_s == pytest.approx(2.0)


def test_step_end_without_start_and_unknown_events() -> None:
    s = Stream().add(0.0, ev.JOB_START).add(1.0, ev.INIT_DONE)
    s.add(3.0, ev.STEP_END, step=1, layout="single", capacity=1.0, tokens=8)
    s.add(3.5, "future_event_kind", detail=1)
    r = compute_goodput(s.events)
    assert r.productive_s == pytest.approx(2.0)  # ran since the previous event
    assert r.total_s == pytest.approx(3.0)  # the unknown event is ignored


def test_invalid_capacity_is_rejected() -> None:
    s = Stream().add(0.0, ev.JOB_START)
    s.add(1.0, ev.STEP_END, step=1, layout="x", capacity=1.5, tokens=1)
    with pytest.raises(ValueError, match="capacity"):
        compute_goodput(s.events)
    with pytest.raises(ValueError, match="no goodput events"):
        compute_goodput([])


@pytest.mark.parametrize("seed", range(12))
def test_random_runs_partition_the_job_time(seed: int) -> None:
    """Random crash/restart/in-process-recovery runs: categories always partition job time,
    every step up to the last is counted once, and redone executions are counted exactly."""
    rng = random.Random(seed)
    s = Stream()
    t, step, ckpt, redone, max_step = 0.0, 0, 0, 0, 0
    for _ in range(rng.randint(1, 4)):  # process lifetimes
        s.add(t, ev.JOB_START)
        t += rng.uniform(0.1, 2)
        s.add(t, ev.INIT_DONE)
        if ckpt:
            s.add(t, ev.CKPT_RESTORE_START)
            t += rng.uniform(0.1, 1)
            s.add(t, ev.CKPT_RESTORE_END, step=ckpt)
        step = ckpt
        for _ in range(rng.randint(1, 15)):
            step += 1
            redone += step <= max_step
            max_step = max(max_step, step)
            cap = rng.choice([1.0, 0.75, 0.5])
            t = s.steps(
                step, start=t + rng.uniform(0, 0.2), duration=rng.uniform(0.2, 1), count=1, capacity=cap
            )
            if rng.random() < 0.3:
                s.add(t, ev.CKPT_SAVE_START, step=step)
                t += rng.uniform(0.05, 0.5)
                s.add(t, ev.CKPT_SAVE_END, step=step)
                ckpt = step
            if rng.random() < 0.1:
                s.add(t + 0.1, ev.DATA_WAIT, seconds=0.05)
        if rng.random() < 0.5:
            s.add(t, ev.STEP_START, step=step + 1)
            t += rng.uniform(0.1, 3)
            s.add(t, ev.FAILURE_DETECTED, rank=rng.randint(0, 7), reason="random")
        t += rng.uniform(0.5, 5)

    r = compute_goodput(s.events)
    assert_partition(r)
    assert r.steps_completed == max_step
    assert r.steps_redone == redone
    assert 0.5 <= r.capacity_fraction <= 1.0
