"""The dashboard's reading of a run directory: goodput fed incrementally into the goodput calculator
agrees with `ntp-goodput`'s batch figures at every point of a stream read as it grows (lines cut in the
middle included), and integrity findings join the incident timeline."""

from __future__ import annotations

import json

import pytest

from ntp_nemo.dashboard.page_state import RunReader
from ntp_nemo.goodput.calculator import breakdown, build_timeline
from ntp_nemo.goodput.incident_log import append_incident
from ntp_nemo.goodput.report import analyse
from ntp_nemo.goodput.synthetic import StreamShape, write_stream


def test_goodput_read_as_the_file_grows_is_the_batch_figure(tmp_path):
    # a job with live, restart and silent failures, written by the real recorder on a synthetic clock
    source = write_stream(tmp_path / "source.jsonl", StreamShape(steps=240, failures=5, seed=3,
                                                                 repair_after=8, ckpt_every=40))
    data = source.read_bytes()
    run = tmp_path / "run"
    run.mkdir()
    target = run / "goodput.jsonl"
    reader = RunReader(run)
    cuts = sorted({len(data) * k // 9 + 17 for k in range(1, 9)} | {len(data)})  # mostly mid-line
    written = 0
    for cut in cuts:
        with target.open("ab") as f:
            f.write(data[written:cut])
        written = cut
        whole = data[: data[:cut].rfind(b"\n") + 1].decode().splitlines()
        events = sorted((json.loads(line) for line in whole), key=lambda e: e["t"])
        want = breakdown(build_timeline(events))
        got = reader.state()["goodput"]["report"]
        assert got["goodput"] == pytest.approx(want.goodput, abs=1e-9), cut
        assert got["badput_s"] == pytest.approx(want.badput_s, abs=1e-6), cut
        assert got["failures"] == want.failures and got["steps_completed"] == want.steps_completed
    report, _ = analyse(run, plot=False)  # what `ntp-goodput RUN_DIR` prints
    final = reader.state()["goodput"]
    assert final["report"]["goodput"] == pytest.approx(report.goodput, abs=1e-9)
    series = final["series"]
    assert series["goodput"][-1] == pytest.approx(100 * report.goodput, abs=1e-7)
    assert series["t"] == sorted(series["t"]) and len(series["t"]) <= 300
    kinds = {e["event"] for e in reader.state()["timeline"]}
    assert {"failure_detected", "recovery_done", "ckpt_save_start"} <= kinds and not kinds & {"step_end"}


def test_integrity_findings_join_the_timeline(tmp_path):
    write_stream(tmp_path, StreamShape(steps=30))
    append_incident(tmp_path, {"step": 12, "kind": "nonfinite", "rank": 1, "verdict": "transient",
                               "action": "step replayed", "cost_s": 0.25})
    rows = [r for r in RunReader(tmp_path).state()["timeline"] if r["event"] == "integrity_finding"]
    assert len(rows) == 1 and rows[0]["cost_s"] == 0.25 and "verdict=transient" in rows[0]["details"]
