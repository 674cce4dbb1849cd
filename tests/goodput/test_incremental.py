"""The incremental GoodputCalculator against the batch calculator: equal bit for bit after every event of
every stream the tests write (the fixtures, the hand-worked streams of the other goodput tests, random
and synthetic streams), in flat memory (a file read a chunk at a time, a bounded history)."""

from __future__ import annotations

import inspect
import json
import random
from pathlib import Path

import pytest

import tests.goodput.test_calculator as calculator_tests
import tests.goodput.test_degraded as degraded_tests
from ntp_nemo.goodput import calculator
from ntp_nemo.goodput import events as ev
from ntp_nemo.goodput.calculator import (
    GoodputCalculator,
    breakdown,
    build_timeline,
    compute_goodput,
    disagreement,
    load_events,
    replay_file,
)
from ntp_nemo.goodput.synthetic import LIVE, RESTART, SILENT, StreamShape, write_stream

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
EVERY_PREFIX = 10**9
SOME_PREFIXES = 40  # longer streams: after 40 evenly spread events and the last (the batch is O(events))


GOODPUT_FIXTURES = sorted(p.relative_to(FIXTURES).as_posix() for p in FIXTURES.rglob("*.jsonl")
                          if p.name == ev.GOODPUT_FILENAME or p.name.startswith("goodput"))


@pytest.mark.parametrize("path", GOODPUT_FIXTURES)
def test_fixture_streams_agree_after_every_event(path: str) -> None:
    events = load_events(FIXTURES / path)
    assert disagreement(events, prefixes=EVERY_PREFIX if len(events) < 200 else SOME_PREFIXES) is None


def _stream_tests() -> list[tuple[str, object]]:
    """The tests of test_calculator and test_degraded that build event streams in process."""
    out = []
    for module in (calculator_tests, degraded_tests):
        for name, fn in vars(module).items():
            if not name.startswith("test_") or not callable(fn):
                continue
            params = set(inspect.signature(fn).parameters)
            if params <= {"seed"} and "compute_goodput" in inspect.getsource(fn):
                seeds = [pytest.param(module, fn, s, id=f"{name}[{s}]") for s in range(12)] if params else [
                    pytest.param(module, fn, None, id=name)]
                out += seeds
    return out


@pytest.mark.parametrize(("module", "test", "seed"), _stream_tests())
def test_streams_of_the_other_goodput_tests_agree_after_every_event(module, test, seed, monkeypatch) -> None:
    """Runs the test again with its calculator checked: every stream it gives `compute_goodput` must give
    the batch figures after each of its events."""
    streams = []

    def checked(events):
        events = list(events)
        streams.append(events)
        # the first few streams of a test after each event, the others (a test of 50 streams) at their end
        prefixes = (EVERY_PREFIX if len(events) < 60 else SOME_PREFIXES) if len(streams) <= 3 else 1
        assert disagreement(events, prefixes=prefixes) is None
        return compute_goodput(events)

    monkeypatch.setattr(module, "compute_goodput", checked)
    test(seed) if seed is not None else test()
    assert streams


def _random_stream(seed: int) -> list[dict]:
    """Lifetimes with restores (some restarted twice), steps with live recoveries (some failing again,
    some recovered twice), rejoins, disruptions, saves with and without their blocking part, aborted and
    unmatched saves, data waits reaching back, failures between lifetimes and failed job ends."""
    rng = random.Random(seed)
    out: list[dict] = []

    def add(t: float, name: str, **fields) -> None:
        out.append({"t": t, "event": name, "pid": 1, **fields})

    t, step, ckpt = 0.0, 0, 0
    for _ in range(rng.randint(1, 4)):
        if rng.random() < 0.9:
            add(t, ev.JOB_START)
        t += rng.uniform(0.1, 2)
        if rng.random() < 0.9:
            add(t, ev.INIT_DONE)
        if ckpt and rng.random() < 0.8:
            add(t, ev.CKPT_RESTORE_START)
            if rng.random() < 0.2:
                t += 0.3
                add(t, ev.CKPT_RESTORE_START)
            t += rng.uniform(0.1, 1)
            add(t, ev.CKPT_RESTORE_END, step=ckpt)
        step = ckpt
        for _ in range(rng.randint(1, 12)):
            step += 1
            t += rng.uniform(0, 0.2)
            if rng.random() < 0.9:
                add(t, ev.STEP_START, step=step)
            r = rng.random()
            if r < 0.15:
                t += rng.uniform(0.05, 0.5)
                add(t, ev.FAILURE_DETECTED, rank=rng.randint(0, 3), reason="collective error")
                for _ in range(rng.randint(0, 2)):
                    t += rng.uniform(0.05, 0.5)
                    seconds = rng.choice([None, 0.1, 0.3, 5.0])
                    add(t, ev.RECOVERY_DONE, layout="(2,1)", mode=rng.choice(["live", "restart"]),
                        **({} if seconds is None else {"recovery_s": seconds}))
                    if rng.random() < 0.3:
                        t += 0.1
                        add(t, ev.FAILURE_DETECTED, rank=1, reason="a rejoin failed")
            elif r < 0.25:
                t += 0.1
                add(t, ev.RECOVERY_DONE, layout="(2,2)", mode="live", rejoin=True,
                    recovery_s=rng.choice([0.05, 0.5]))
            elif r < 0.3:
                t += 0.1
                add(t, ev.INIT_DONE)
            t += rng.uniform(0.2, 1)
            if rng.random() < 0.3:
                add(t - 0.05, ev.CKPT_SAVE_START, step=step)
                add(t - 0.01, ev.CKPT_SAVE_END, step=step, blocking_s=rng.choice([0.01, 0.02, 1.0]))
            add(t, ev.STEP_END, step=step, layout=rng.choice(["(2,2)", "(2,1)"]),
                capacity=rng.choice([1.0, 0.75]), tokens=8)
            if rng.random() < 0.3:
                add(t, ev.CKPT_SAVE_START, step=step)
                t += rng.uniform(0.05, 0.5)
                k = rng.random()
                if k < 0.6:
                    add(t, ev.CKPT_SAVE_END, step=step,
                        **({"blocking_s": rng.uniform(0, 0.6)} if rng.random() < 0.5 else {}))
                elif k < 0.8:
                    add(t, ev.CKPT_SAVE_ABORT, step=step, reason="OSError")
                ckpt = step
            if rng.random() < 0.15:
                add(t + 0.1, ev.DATA_WAIT, seconds=rng.choice([0.05, 0.3, 2.0]))
            if rng.random() < 0.05:
                add(t + 0.01, ev.CKPT_RESTORE_END, step=1)
            if rng.random() < 0.05:
                add(t + 0.02, ev.CKPT_SAVE_END, step=99, blocking_s=0.3)
        k = rng.random()
        if k < 0.4:
            t += 0.01
            add(t, ev.STEP_START, step=step + 1)
            t += rng.uniform(0.1, 3)
            if rng.random() < 0.5:
                add(t, ev.FAILURE_DETECTED, rank=rng.randint(0, 7), reason="exit code -9")
            if rng.random() < 0.3:
                add(t + 0.1, ev.RECOVERY_DONE, layout="(2,2)", mode="restart")
        elif k < 0.6:
            add(t + 0.01, ev.JOB_END, status="failed")
        elif k < 0.8:
            add(t + 0.01, ev.JOB_END, status="ok")
        t += rng.uniform(0.5, 5)
        if rng.random() < 0.2:
            add(t - 0.2, ev.FAILURE_DETECTED, rank=2, reason="heartbeat timeout")
    return out


@pytest.mark.parametrize("seed", range(16))
def test_random_streams_agree_after_every_event(seed: int) -> None:
    assert disagreement(_random_stream(seed), prefixes=EVERY_PREFIX) is None


@pytest.mark.parametrize("kinds", [(LIVE,), (RESTART,), (SILENT,), (LIVE, RESTART, SILENT)])
def test_synthetic_streams_agree(tmp_path: Path, kinds: tuple[str, ...]) -> None:
    """Streams written through the recorder by the synthetic generator, every failure kind."""
    file = write_stream(tmp_path, StreamShape(steps=240, failures=8, seed=len(kinds), kinds=kinds,
                                              ckpt_every=50, repair_after=5))
    events = load_events(file)
    assert disagreement(events, prefixes=SOME_PREFIXES) is None
    report = compute_goodput(events)
    assert report.failures >= 1 and report.productive_s > 0
    if RESTART in kinds or SILENT in kinds:
        assert report.steps_redone > 0


def test_a_short_history_gives_the_same_figures(tmp_path: Path) -> None:
    """Restarts redo steps whose first execution left the history long before: the figures are the
    same with a 30 s history as with the default hour (segments no event can reach are forgotten)."""
    file = write_stream(tmp_path, StreamShape(steps=1500, failures=10, seed=3, kinds=(RESTART, LIVE),
                                              ckpt_every=300, repair_after=5))
    short = replay_file(file, GoodputCalculator(history_s=30.0))
    assert len(short._hist) < 1000  # noqa: SLF001 - the point: the history stays bounded
    assert short.clipped_s == 0.0
    full = breakdown(build_timeline(load_events(file)))
    assert short.report() == full and full.steps_redone > 0


def test_a_file_read_in_small_chunks_and_out_of_order(tmp_path: Path, monkeypatch) -> None:
    """Chunk boundaries anywhere, events stamped before earlier lines (a failure recorded at its
    detection time after later events): the same figures as the whole file sorted."""
    events = _random_stream(7) + _random_stream(8)
    for e in events[len(events) // 2:]:
        e["t"] += 100.0
    random.Random(0).shuffle(events[:20])  # out of order far beyond one chunk
    file = tmp_path / ev.GOODPUT_FILENAME
    file.write_text("".join(json.dumps(e) + "\n" for e in events))
    expected = breakdown(build_timeline(events))
    monkeypatch.setattr(calculator, "_CHUNK_BYTES", 512)
    assert replay_file(file).report() == expected
    events.sort(key=lambda e: e["t"])
    events[30], events[31] = events[31], events[30]  # out of order within a chunk
    file.write_text("".join(json.dumps(e) + "\n" for e in events))
    assert replay_file(file).report() == breakdown(build_timeline(events))


def test_late_events_fed_live_are_counted_at_the_last_time() -> None:
    calc = GoodputCalculator()
    calc.feed({"t": 10.0, "event": ev.JOB_START})
    calc.feed({"t": 12.0, "event": ev.INIT_DONE})
    calc.feed({"t": 11.0, "event": ev.DATA_WAIT, "seconds": 0.5})  # a thread's, stamped earlier
    assert calc.late_events == 1
    report = calc.report()
    assert report.total_s == pytest.approx(2.0)
    assert report.badput_s[ev.INITIALIZATION] == pytest.approx(2.0)  # init outranks the wait


def test_window_and_series_place_time_where_it_was_spent() -> None:
    """One hour healthy, then an hour with a restart that redoes the first hour's last 30 minutes: the
    last hour's window shows that hour only; the series moves the redone steps' first runs to wasted."""
    calc = GoodputCalculator(window_s=3600.0, bucket_s=600.0)
    t = 0.0
    calc.feed({"t": t, "event": ev.JOB_START})
    calc.feed({"t": t, "event": ev.INIT_DONE})
    for step in range(1, 61):  # 60 steps of a minute
        calc.feed({"t": t, "event": ev.STEP_START, "step": step})
        t += 60.0
        calc.feed({"t": t, "event": ev.STEP_END, "step": step, "layout": "(2,2)", "capacity": 1.0})
    calc.feed({"t": t, "event": ev.FAILURE_DETECTED, "rank": 0, "reason": "exit code -9"})
    calc.feed({"t": t, "event": ev.JOB_START})
    calc.feed({"t": t, "event": ev.INIT_DONE})
    for step in range(31, 91):  # redoes 31-60
        calc.feed({"t": t, "event": ev.STEP_START, "step": step})
        t += 60.0
        calc.feed({"t": t, "event": ev.STEP_END, "step": step, "layout": "(2,2)", "capacity": 1.0})
    report = calc.report()
    assert report.productive_s == pytest.approx(90 * 60.0)
    assert report.badput_s[ev.WASTED_PROGRESS] == pytest.approx(30 * 60.0)
    window = calc.window()
    assert window.total_s == pytest.approx(3600.0)
    assert window.goodput == pytest.approx(1.0)
    series = calc.series()
    assert [b["badput_s"][ev.WASTED_PROGRESS] for b in series[:6]] == pytest.approx([0, 0, 0] + [600.0] * 3)
    assert sum(b["total_s"] for b in series) == pytest.approx(report.total_s)
