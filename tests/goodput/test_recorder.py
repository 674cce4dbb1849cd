"""Goodput recorder: append-only JSONL that several process lifetimes share; load_events errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ntp_nemo.errors import ConfigError
from ntp_nemo.goodput import GOODPUT_FILENAME, GoodputRecorder, compute_goodput, load_events
from ntp_nemo.goodput import events as ev

REPO = Path(__file__).resolve().parents[2]


def test_record_roundtrip(tmp_path: Path) -> None:
    with GoodputRecorder(tmp_path / "run") as rec:  # a run directory that does not exist yet
        written = rec.record(
            ev.STEP_END, step=np.int64(3), layout="tp4+tp3", capacity=np.float32(0.875), tokens=64
        )
        rec.record(ev.FAILURE_DETECTED, rank=2, reason="exit code -9")
    lines = (tmp_path / "run" / GOODPUT_FILENAME).read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first == {**written, "step": 3, "capacity": 0.875}
    assert first["pid"] == os.getpid() and first["event"] == ev.STEP_END
    assert load_events(tmp_path / "run") == [json.loads(line) for line in lines]


def test_unknown_event_name_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown goodput event"):
        GoodputRecorder(tmp_path).record("step_ended", step=1)
    assert not (tmp_path / GOODPUT_FILENAME).exists()


def test_restarted_processes_append_to_one_file(tmp_path: Path) -> None:
    """Each lifetime is a separate process appending to the same file; earlier lines survive."""
    script = (
        "import sys\n"
        "from ntp_nemo.goodput import GoodputRecorder\n"
        "rec = GoodputRecorder(sys.argv[1])\n"
        "first = int(sys.argv[2])\n"
        "rec.record('job_start'); rec.record('init_done')\n"
        "for s in range(first, first + 3):\n"
        "    rec.record('step_start', step=s)\n"
        "    rec.record('step_end', step=s, layout='single', capacity=1.0)\n"
        "if first > 1: rec.record('job_end', status='ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for first in (1, 2):  # the first lifetime dies after step 3; the second resumes from step 1's checkpoint
        subprocess.run([sys.executable, "-c", script, str(tmp_path), str(first)], check=True, env=env)

    events = load_events(tmp_path)
    assert len({e["pid"] for e in events}) == 2
    assert [e["event"] for e in events].count(ev.JOB_START) == 2
    report = compute_goodput(events)
    assert (report.lifetimes, report.steps_completed, report.steps_redone, report.failures) == (2, 4, 2, 1)


def test_fsync_only_at_events_that_must_survive_a_crash(tmp_path: Path, monkeypatch) -> None:
    """Per-step events cost a write, not an fsync; job start/end, failures, recoveries and the ends of
    saves and restores are synced at once; with a bound of 0 s every event is synced."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    rec = GoodputRecorder(tmp_path, sync_every_s=3600.0)
    rec.record(ev.JOB_START)
    assert len(synced) == 1
    for s in range(1, 51):
        rec.record(ev.STEP_START, step=s)
        rec.record(ev.STEP_END, step=s, layout="(2,1)", capacity=0.75, tokens=64)
    rec.record(ev.CKPT_SAVE_START, step=50)
    assert len(synced) == 1  # 101 events, no fsync
    for name, fields in ((ev.CKPT_SAVE_END, {"step": 50}), (ev.CKPT_COMMIT, {"step": 50, "ok": True}),
                         (ev.FAILURE_DETECTED, {"rank": 1}), (ev.RECOVERY_DONE, {"layout": "(1,1)"}),
                         (ev.JOB_END, {"status": "ok"})):
        rec.record(name, **fields)
    assert len(synced) == 6
    rec.close()
    assert len(load_events(tmp_path)) == 107  # every line is in the file, synced or not

    every = GoodputRecorder(tmp_path / "b", sync_every_s=0.0)
    every.record(ev.STEP_START, step=1)
    every.record(ev.STEP_END, step=1, layout="(2,1)", capacity=0.75)
    assert len(synced) == 8
    never = GoodputRecorder(tmp_path / "c", fsync=False)
    never.record(ev.JOB_START)
    assert len(synced) == 8


def test_load_events_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as err:
        load_events(tmp_path)
    assert str(tmp_path / GOODPUT_FILENAME) in str(err.value)

    file = tmp_path / GOODPUT_FILENAME
    file.write_text("\n")
    with pytest.raises(ConfigError, match="holds no events"):
        load_events(tmp_path)

    file.write_text('{"t": 1.0, "event": "job_start"}\n{"t": 2.0, "ev\n{"t": 3.0, "event": "job_end"}\n')
    with pytest.raises(ConfigError, match=f"{GOODPUT_FILENAME}:2 is not valid JSON"):
        load_events(tmp_path)

    file.write_text('{"t": "noon", "event": "job_start"}\n')
    with pytest.raises(ConfigError, match="numeric 't'"):
        load_events(tmp_path)


def test_truncated_last_line_from_a_crash_is_skipped(tmp_path: Path) -> None:
    rec = GoodputRecorder(tmp_path)
    rec.record(ev.JOB_START)
    rec.close()
    with open(tmp_path / GOODPUT_FILENAME, "a") as f:
        f.write('{"t": 5.0, "event": "step_e')  # killed in mid-write
    with pytest.warns(UserWarning, match="truncated last line"):
        events = load_events(tmp_path)
    assert [e["event"] for e in events] == [ev.JOB_START]
