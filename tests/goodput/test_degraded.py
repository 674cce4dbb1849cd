"""Goodput's degraded-throughput and reshard categories, and the running goodput sent to the loggers.

Synthetic streams with answers worked out by hand; the events of a real live failover run
(tests/fixtures/goodput_live_failover.jsonl, written by the `ntp-train` command in `LIVE_RUN` below);
the running figures in a real TensorBoard event file, in process here and through the CLI in
tests/resilience/test_live_failover_cli.py (its sweep's `live` run logs to TensorBoard; the helpers are
these).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ntp_nemo.goodput import BADPUT_CATEGORIES, compute_goodput, load_events, summary_line
from ntp_nemo.goodput import events as ev
from tests.conftest import TINY

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "goodput_live_failover.jsonl"
# The run that wrote FIXTURE (rank 3 of (2,2) killed when step 3 starts; the survivors reshard live).
LIVE_RUN = [*TINY, "mesh.dp=2", "mesh.tp=2", "ntp.replica_tp=[2,2]", "trainer.max_steps=8",
            "checkpoint.save_on_end=false", "fault=kill_rank", "fault.rank=3", "fault.step=3",
            "fault.recovery=live"]


def _e(t: float, event: str, **fields) -> dict:
    return {"t": t, "event": event, "pid": 1, **fields}


def _steps(first: int, start: float, duration: float, count: int, layout: str, capacity: float) -> list[dict]:
    out, t = [], start
    for step in range(first, first + count):
        out.append(_e(t, ev.STEP_START, step=step))
        t += duration
        out.append(_e(t, ev.STEP_END, step=step, layout=layout, capacity=capacity, tokens=64))
    return out


def _adds_up(r) -> None:
    assert set(r.badput_s) == set(BADPUT_CATEGORIES)
    assert all(v >= 0 for v in r.badput_s.values())
    assert r.productive_s + sum(r.badput_s.values()) == pytest.approx(r.total_s, abs=1e-9)


def test_categories_are_reported_in_order() -> None:
    cats = list(BADPUT_CATEGORIES)
    assert cats.index(ev.RECOVERY_DOWNTIME) < cats.index(ev.RESHARD) < cats.index(ev.DEGRADED_THROUGHPUT)
    assert cats[-1] == ev.OTHER


def test_live_recovery_splits_into_wasted_downtime_reshard_and_degraded() -> None:
    # 0-1 init; steps 1-4 healthy (1 s each, 1 -> 5); step 5 starts at 5.0, rank 3 lost, detected at 5.4;
    # the reshard takes 0.5 s and ends at 6.0 (recovery_done); step 5 redone 6 -> 7 on (2,1) at capacity
    # 0.75, then steps 6-7 (7 -> 9); job_end at 9.
    events = [_e(0.0, ev.JOB_START), _e(1.0, ev.INIT_DONE), *_steps(1, 1.0, 1.0, 4, "(2,2)", 1.0),
              _e(5.0, ev.STEP_START, step=5), _e(5.4, ev.FAILURE_DETECTED, rank=3, reason="collective error"),
              _e(6.0, ev.RECOVERY_DONE, layout="(2,1)", mode="live", recovery_s=0.5),
              _e(7.0, ev.STEP_END, step=5, layout="(2,1)", capacity=0.75, tokens=64),
              *_steps(6, 7.0, 1.0, 2, "(2,1)", 0.75), _e(9.0, ev.JOB_END, status="ok")]
    r = compute_goodput(events)
    _adds_up(r)
    assert r.total_s == pytest.approx(9.0)
    assert r.badput_s[ev.INITIALIZATION] == pytest.approx(1.0)
    assert r.badput_s[ev.WASTED_PROGRESS] == pytest.approx(0.4)  # step 5 before the detection
    assert r.badput_s[ev.RESHARD] == pytest.approx(0.5)  # 5.5 -> 6.0
    assert r.badput_s[ev.RECOVERY_DOWNTIME] == pytest.approx(0.1)  # detection 5.4 -> reshard start 5.5
    # 3 s of steps on (2,1) at capacity 0.75: 2.25 s of progress, 0.75 s below full capacity.
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(0.75)
    assert r.productive_s == pytest.approx(4.0 + 2.25)
    assert r.goodput == pytest.approx(6.25 / 9.0)
    assert r.progress_goodput == pytest.approx(7.0 / 9.0)
    assert r.capacity_fraction == pytest.approx(6.25 / 7.0)
    assert r.badput_s[ev.OTHER] == pytest.approx(0.0)
    line = summary_line(r)
    assert "reshard 0.5 s" in line and "degraded 0.8 s" in line


def test_rejoin_reshard_inside_a_step_is_carved_out_of_it() -> None:
    # A rejoin runs at the start of step 3 (after its step_start): 0.3 s of reshard, then the step on the
    # full layout again. Steps 1-2 ran degraded at 0.5.
    events = [_e(0.0, ev.JOB_START), _e(0.0, ev.INIT_DONE), *_steps(1, 0.0, 2.0, 2, "(2,1)", 0.5),
              _e(4.0, ev.STEP_START, step=3),
              _e(4.3, ev.RECOVERY_DONE, layout="(2,2)", mode="live", rejoin=True, recovery_s=0.3),
              _e(5.3, ev.STEP_END, step=3, layout="(2,2)", capacity=1.0, tokens=64),
              _e(5.3, ev.JOB_END, status="ok")]
    r = compute_goodput(events)
    _adds_up(r)
    assert r.badput_s[ev.RESHARD] == pytest.approx(0.3)
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(2.0)  # 4 s at capacity 0.5
    assert r.productive_s == pytest.approx(2.0 + 1.0)
    assert r.badput_s[ev.RECOVERY_DOWNTIME] == 0.0 and r.failures == 0


@pytest.mark.parametrize("done", [
    {"mode": "restart", "recovery_s": 0.5},  # a relaunch: its time is restore and init, not a reshard
    {"mode": "live"},  # no recovery_s recorded: nothing to place
    {"mode": "live", "recovery_s": "0.5"},
])
def test_only_a_live_recovery_with_its_seconds_is_a_reshard(done: dict) -> None:
    events = [_e(0.0, ev.JOB_START), _e(0.0, ev.INIT_DONE), *_steps(1, 0.0, 1.0, 2, "(2,2)", 1.0),
              _e(2.0, ev.STEP_START, step=3), _e(2.2, ev.FAILURE_DETECTED, rank=1),
              _e(3.0, ev.RECOVERY_DONE, layout="(2,1)", **done),
              _e(4.0, ev.STEP_END, step=3, layout="(2,1)", capacity=0.75, tokens=64),
              _e(4.0, ev.JOB_END, status="ok")]
    r = compute_goodput(events)
    _adds_up(r)
    assert r.badput_s[ev.RESHARD] == 0.0
    assert r.badput_s[ev.RECOVERY_DOWNTIME] == pytest.approx(0.8)
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(0.25)


def test_random_streams_add_up_to_the_wall_time() -> None:
    rng = random.Random(7)
    for _ in range(50):
        events, t = [_e(0.0, ev.JOB_START), _e(0.5, ev.INIT_DONE)], 0.5
        for step in range(1, 30):
            events.append(_e(t, ev.STEP_START, step=step))
            if rng.random() < 0.1:
                detect = t + rng.uniform(0, 0.3)
                events.append(_e(detect, ev.FAILURE_DETECTED, rank=1))
                reshard = rng.uniform(0.05, 0.5)
                t = detect + reshard + rng.uniform(0, 0.1)
                events.append(_e(t, ev.RECOVERY_DONE, layout="x", mode="live", recovery_s=reshard))
            t += rng.uniform(0.1, 1.0)
            events.append(_e(t, ev.STEP_END, step=step, layout="x", capacity=rng.choice([1.0, 0.875, 0.5])))
        r = compute_goodput(events)
        _adds_up(r)
        assert r.badput_s[ev.RESHARD] > 0 or r.failures == 0


def _covered(a: float, b: float, spans: list[tuple[float, float]]) -> float:
    """Seconds of [a, b] inside the union of `spans`."""
    total, reach = 0.0, a
    for lo, hi in sorted(spans):
        lo, hi = max(lo, reach), min(hi, b)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


def _execution_seconds(events: list[dict]) -> tuple[float, float]:
    """(degraded seconds, reshard seconds) read straight off a real run's events: each step execution
    that ends with a step_end of capacity c < 1 lost (1 - c) of its length, starting from its
    step_start or, for a step redone after a live recovery, from the recovery's end. A data wait is
    recorded summed, as one span ending where it is written, so it can reach back over earlier steps and
    reshards; the seconds it covers are data loading, not stepping (the calculator's documented rule:
    the more specific measurement wins), and are left out here."""
    waits = [(e["t"] - e["seconds"], e["t"]) for e in events if e["event"] == ev.DATA_WAIT]
    degraded, reshard, start = 0.0, 0.0, None
    for e in sorted(events, key=lambda e: e["t"]):
        if e["event"] == ev.STEP_START:
            start = e["t"]
        elif e["event"] == ev.RECOVERY_DONE and e.get("mode") == "live":
            reshard += e["recovery_s"] - _covered(e["t"] - e["recovery_s"], e["t"], waits)
            start = e["t"]
        elif e["event"] == ev.STEP_END:
            length = e["t"] - start - _covered(start, e["t"], waits)
            degraded += (1 - e["capacity"]) * length
    return degraded, reshard


def test_a_summed_data_wait_reaching_into_a_degraded_step_is_data_loading() -> None:
    # The end-of-training flush writes 0.2 s of summed waits 0.1 s after the last degraded step ends: its
    # span covers the step's last 0.1 s, which is data loading, so that step degrades only 0.9 s of its 1 s.
    events = [_e(0.0, ev.JOB_START), _e(0.0, ev.INIT_DONE), *_steps(1, 0.0, 1.0, 2, "(2,1)", 0.75),
              _e(2.1, ev.DATA_WAIT, seconds=0.2), _e(2.1, ev.JOB_END, status="ok")]
    r = compute_goodput(events)
    _adds_up(r)
    assert r.badput_s[ev.DATA_LOADING] == pytest.approx(0.2)
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(0.25 + 0.25 * 0.9)
    assert _execution_seconds(events)[0] == pytest.approx(0.25 + 0.25 * 0.9)


def test_events_of_a_real_live_failover_run() -> None:
    events = load_events(FIXTURE)
    assert any(e["event"] == ev.RECOVERY_DONE and e["mode"] == "live" for e in events)
    degraded, reshard = _execution_seconds(events)
    assert degraded > 0 and reshard > 0
    r = compute_goodput(events)
    _adds_up(r)
    assert r.total_s == pytest.approx(events[-1]["t"] - events[0]["t"])
    assert r.badput_s[ev.DEGRADED_THROUGHPUT] == pytest.approx(degraded, rel=1e-9)
    assert r.badput_s[ev.RESHARD] == pytest.approx(reshard, rel=1e-9)
    assert r.capacity_fraction < 1.0 and r.goodput < r.progress_goodput


def _ntp_goodput(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    return subprocess.run([sys.executable, "-m", "ntp_nemo.cli.goodput", *args], capture_output=True,
                          text=True, env=env, timeout=120)


def test_ntp_goodput_shows_the_new_categories_of_a_real_run() -> None:
    proc = _ntp_goodput(str(FIXTURE), "--json", "--no-plot")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["productive_s"] + sum(got["badput_s"].values()) == pytest.approx(got["total_s"])
    assert got["badput_s"]["reshard"] > 0 and got["badput_s"]["degraded_throughput"] > 0
    proc = _ntp_goodput(str(FIXTURE), "--no-plot")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("│")[1].strip(): line for line in proc.stdout.splitlines() if line.count("│") >= 3}
    assert f"{got['badput_s']['reshard']:.2f}" in rows["reshard"]
    assert f"{got['badput_s']['degraded_throughput']:.2f}" in rows["degraded_throughput"]
    assert f"{100 * got['progress_goodput']:.1f}" in rows["progress at any capacity"]


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {log_dir}"
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    return {tag: [(s.step, s.value) for s in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_running_goodput_reaches_tensorboard_in_process(tmp_path: Path) -> None:
    """The callback's hook on a stand-in trainer with a real TensorBoardLogger: the earlier lifetime in
    the file (written by another recorder) and the events of this one are both counted."""
    from lightning.pytorch.loggers import TensorBoardLogger

    from ntp_nemo.goodput.recorder import GoodputRecorder
    from ntp_nemo.lightning.goodput_callback import GoodputCallback

    with GoodputRecorder(tmp_path) as rec:
        rec.record(ev.JOB_START, layout="(2,2)")  # as the launcher writes it before forking
    cb = GoodputCallback(str(tmp_path), job_started=True)
    cb.set_global_zero(True)
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = SimpleNamespace(loggers=[logger], log_every_n_steps=2, global_step=0,
                              strategy=SimpleNamespace(layout_info={"layout": "(2,1)", "capacity": 0.75}))
    module = SimpleNamespace(last_step={"tokens": 64})
    cb.on_train_start(trainer, module)
    for step in range(1, 5):
        trainer.global_step = step - 1
        cb.on_train_batch_start(trainer, module, None, step - 1)
        trainer.global_step = step
        cb.on_train_batch_end(trainer, module, None, None, step - 1)
    logger.finalize("success")
    final = cb.running_report()
    assert final is not None and final.badput_s[ev.DEGRADED_THROUGHPUT] > 0
    scalars = _scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["goodput/goodput"]] == [2, 4]
    assert {f"goodput/{c}_s" for c in BADPUT_CATEGORIES} <= set(scalars)
    assert {f"goodput/window/{c}_s" for c in BADPUT_CATEGORIES} <= set(scalars)
    assert [s for s, _ in scalars["goodput/window/goodput"]] == [2, 4]
    # The figure at step 4 is the report of every event up to step 4's end (the file's job_start included).
    _, value = scalars["goodput/total_s"][-1]
    assert value == pytest.approx(final.total_s, rel=1e-5)
    assert scalars["goodput/capacity_fraction"][-1][1] == pytest.approx(0.75, rel=1e-6)


def test_running_goodput_never_stops_and_equals_the_file_figure(tmp_path: Path) -> None:
    """Logged at every step it is asked for, however long the job (it used to stop after some 20,000
    steps); what the loggers receive at a step is exactly the batch figure of the file up to that step,
    including a live recovery and a rejoin recorded through the callback as the strategy records them."""
    from ntp_nemo.goodput.calculator import breakdown, build_timeline
    from ntp_nemo.lightning import goodput_callback as gc

    class Sink:
        def __init__(self) -> None:
            self.logged: dict[int, dict] = {}

        def log_metrics(self, metrics: dict, step: int) -> None:
            self.logged[step] = metrics

    sink = Sink()
    cb = gc.GoodputCallback(str(tmp_path), window_s=3600.0)
    cb.set_global_zero(True)
    strategy = SimpleNamespace(layout_info={"layout": "(2,2)", "capacity": 1.0})
    trainer = SimpleNamespace(loggers=[sink], log_every_n_steps=7, global_step=0, strategy=strategy)
    module = SimpleNamespace(last_step={"tokens": 64})
    cb.setup(SimpleNamespace(is_global_zero=True, **vars(trainer)), module, "fit")
    cb.on_train_start(trainer, module)
    checked = 0
    for step in range(1, 300):
        trainer.global_step = step - 1
        cb.on_train_batch_start(trainer, module, None, step - 1)
        if step == 100:  # a rank lost inside the step, resharded live; its replacement rejoins at 150
            cb.record(ev.FAILURE_DETECTED, rank=3, reason="collective error", step=step)
            cb.record(ev.RECOVERY_DONE, layout="(2,1)", step=step, mode="live", recovery_s=1e-4)
            strategy.layout_info = {"layout": "(2,1)", "capacity": 0.75}
        if step == 150:
            cb.record(ev.RECOVERY_DONE, layout="(2,2)", step=step, mode="live", rejoin=True, recovery_s=1e-4)
            strategy.layout_info = {"layout": "(2,2)", "capacity": 1.0}
        trainer.global_step = step
        cb.on_train_batch_end(trainer, module, None, None, step - 1)
        if step in (105, 154, 294):
            batch = breakdown(build_timeline(load_events(tmp_path)))
            assert sink.logged[step] == gc.goodput_metrics(batch, cb.running_calculator().window())
            checked += 1
    assert checked == 3
    assert sorted(sink.logged) == list(range(7, 300, 7))
    last = sink.logged[294]
    assert last["goodput/degraded_throughput_s"] > 0 and last["goodput/reshard_s"] > 0
    # the hour's window holds the whole job here: its figures add up to the cumulative ones
    assert last["goodput/window/total_s"] == pytest.approx(last["goodput/total_s"], rel=1e-6)
