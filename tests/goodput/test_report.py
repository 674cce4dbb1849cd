"""`ntp-goodput RUN_DIR` through a real subprocess: table, JSON, PNG timeline, exit code 2 on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_nemo.goodput import GOODPUT_FILENAME
from ntp_nemo.goodput import events as ev
from ntp_nemo.goodput.report import TIMELINE_PNG

REPO = Path(__file__).resolve().parents[2]

# The breakdown of the `run_dir` events below, worked out by hand (seconds from the first job_start):
# job time 0 -> 12.5; productive: the last completed run of steps 1-6, 1 s each, steps 3-6 at capacity
# 0.875: 2 + 4 x 0.875 = 5.5 (goodput 44.0%), degraded throughput 4 x 0.125 = 0.5;
# initialization 0->1 and 7->8 = 2.0; restore 8->8.5 = 0.5; wasted progress: steps 3 and 4 of the
# first lifetime (undone by the restore of step 2) and step 5 cut by the failure at 5.5 = 2.5;
# recovery downtime: the failure at 5.5 until the next job starts at 7 = 1.5. Capacity over the
# productive time: (2 s x 1.0 + 4 s x 0.875) / 6 s.
EXPECTED = {
    "total_s": 12.5,
    "productive_s": 5.5,
    "goodput": 0.44,
    "degraded_throughput": 0.5,
    "initialization": 2.0,
    "checkpoint_restore": 0.5,
    "wasted_progress": 2.5,
    "recovery_downtime": 1.5,
    "capacity_fraction": (2 * 1.0 + 4 * 0.875) / 6,
}


def ntp_goodput(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "120"}
    cmd = [sys.executable, "-m", "ntp_nemo.cli.goodput", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    """Two lifetimes: a crash after step 4, a restore of step 2, a degraded layout from then on."""
    lines = []

    def add(t: float, event: str, **fields) -> None:
        lines.append(json.dumps({"t": 1.7e9 + t, "event": event, "pid": 10, **fields}))

    add(0, ev.JOB_START)
    add(1, ev.INIT_DONE)
    for step in range(1, 5):
        add(step, ev.STEP_START, step=step)
        add(step + 1, ev.STEP_END, step=step, layout="tp4x2", capacity=1.0, tokens=64)
        if step == 2:
            add(3, ev.CKPT_SAVE_START, step=2)
            add(3, ev.CKPT_SAVE_END, step=2)
    add(5, ev.STEP_START, step=5)
    add(5.5, ev.FAILURE_DETECTED, rank=5, reason="exit code -9")
    add(7, ev.JOB_START)
    add(8, ev.INIT_DONE)
    add(8, ev.CKPT_RESTORE_START)
    add(8.5, ev.CKPT_RESTORE_END, step=2)
    add(8.5, ev.RECOVERY_DONE, layout="tp4+tp3")
    for step in range(3, 7):
        t = 8.5 + (step - 3)
        add(t, ev.STEP_START, step=step)
        add(t + 1, ev.STEP_END, step=step, layout="tp4+tp3", capacity=0.875, tokens=64)
    add(12.5, ev.JOB_END, status="ok")
    (tmp_path / GOODPUT_FILENAME).write_text("\n".join(lines) + "\n")
    return tmp_path


def test_cli_prints_breakdown_and_writes_timeline(run_dir: Path) -> None:
    proc = ntp_goodput(str(run_dir))
    assert proc.returncode == 0, proc.stderr
    for category in (*ev.BADPUT_CATEGORIES, "productive", "goodput", "NTP capacity fraction", "steps redone"):
        assert category in proc.stdout
    assert "44.0" in proc.stdout  # goodput, %
    assert "2.50" in proc.stdout and "1.50" in proc.stdout  # wasted progress, recovery downtime (s)
    png = run_dir / TIMELINE_PNG
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.stat().st_size > 10_000  # a drawn figure, not an empty canvas
    assert str(png) in proc.stdout.replace("\n", "")


def test_cli_json_matches_calculator(run_dir: Path) -> None:
    proc = ntp_goodput(str(run_dir / GOODPUT_FILENAME), "--json", "--no-plot")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    for key in ("total_s", "productive_s", "goodput", "capacity_fraction"):
        assert got[key] == pytest.approx(EXPECTED[key]), key
    for key in ("initialization", "checkpoint_restore", "wasted_progress", "recovery_downtime",
                "degraded_throughput"):
        assert got["badput_s"][key] == pytest.approx(EXPECTED[key]), key
    assert got["productive_s"] + sum(got["badput_s"].values()) == pytest.approx(got["total_s"])
    assert (got["steps_completed"], got["steps_redone"], got["failures"], got["lifetimes"]) == (6, 2, 1, 2)
    assert not (run_dir / TIMELINE_PNG).exists()


@pytest.mark.parametrize("content", [None, "", "not json at all\n{}\n"])
def test_cli_bad_input_exits_2_naming_the_path(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / GOODPUT_FILENAME).write_text(content)
    proc = ntp_goodput(str(tmp_path))
    assert proc.returncode == 2
    assert str(tmp_path / GOODPUT_FILENAME) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_legend_lists_only_what_the_run_has(run_dir: Path, tmp_path: Path) -> None:
    from ntp_nemo.goodput.calculator import build_timeline, load_events
    from ntp_nemo.goodput.report import legend_labels

    full = legend_labels(build_timeline(load_events(run_dir)))
    assert full == [
        "step on tp4x2",
        "step on tp4+tp3",
        "wasted step",
        "ckpt save",
        "ckpt restore",
        "init",
        "failure -> first step",
    ]
    clean = tmp_path / "clean"
    clean.mkdir()
    lines = [{"t": 0, "event": ev.JOB_START}, {"t": 1, "event": ev.INIT_DONE}]
    for step in (1, 2):
        lines += [{"t": step, "event": ev.STEP_START, "step": step}]
        lines += [{"t": step + 1, "event": ev.STEP_END, "step": step, "layout": "(2,1)", "capacity": 0.75}]
    lines += [{"t": 3, "event": ev.JOB_END, "status": "ok"}]
    (clean / GOODPUT_FILENAME).write_text("".join(json.dumps({"pid": 1, **e}) + "\n" for e in lines))
    assert legend_labels(build_timeline(load_events(clean))) == ["step on (2,1)", "init"]
