"""The goodput report of a job with a thousand failures stays readable: failures summarised by kind and
cost, the longest named, no row per failure, in the table and in the end-of-run summary line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from ntp_nemo.goodput.calculator import LIST_EACH_UP_TO, failure_kinds, summary_line
from ntp_nemo.goodput.report import LONGEST, MAX_KIND_ROWS, analyse, breakdown_table
from ntp_nemo.goodput.synthetic import LIVE, RESTART, StreamShape, write_stream


@pytest.fixture(scope="module")
def thousand(tmp_path_factory: pytest.TempPathFactory):
    """A job of 6,000 steps and 1,000 failures (recovered live and by restart), written by the recorder."""
    run = tmp_path_factory.mktemp("thousand")
    write_stream(run, StreamShape(steps=6000, failures=1000, seed=11, ckpt_every=20, repair_after=2,
                                  data_wait_every=0, kinds=(LIVE, RESTART)))
    report, png = analyse(run, plot=False)
    return report, png


def _table_text(report) -> str:
    console = Console(record=True, width=140)
    console.print(breakdown_table(report))
    return console.export_text()


def test_a_thousand_failures_are_summarised_by_kind_with_the_longest_listed(thousand) -> None:
    report, png = thousand
    assert png is None
    assert report.failures == 1000
    text = _table_text(report)
    rows = [line for line in text.splitlines() if line.startswith("│")]
    assert len(rows) < 50  # readable: not a row per failure
    assert not re.search(r"failure \d+ .*: (live|restart) recovery", text)  # the per-failure row format
    kinds = failure_kinds(report)
    assert 1 < len(kinds) <= MAX_KIND_ROWS
    assert sum(k["count"] for k in kinds) == report.failures
    # one row per kind, its count and total recovery seconds as computed from the report
    for k in kinds:
        row = next(r for r in rows if f"{k['count']} x {k['mode']} recovery after {k['reason']}" in r)
        assert f"{k['total_s']:.2f}" in row
    # the five longest recoveries, longest first, with their seconds
    listed = [r for r in rows if "longest: failure" in r]
    assert len(listed) == LONGEST
    longest = sorted((r["recovery_s"] for r in report.failure_recoveries), reverse=True)[:LONGEST]
    seconds = [float(r.split("│")[2]) for r in listed]
    assert seconds == pytest.approx(longest, abs=0.006)
    # the first listed is the failure the report numbers so, in time order
    number = int(re.search(r"longest: failure (\d+)", listed[0]).group(1))
    assert report.failure_recoveries[number - 1]["recovery_s"] == pytest.approx(longest[0])


def test_the_summary_line_of_a_thousand_failures_is_one_short_line(thousand) -> None:
    report, _ = thousand
    line = summary_line(report)
    assert len(line) < 400 and "\n" not in line
    assert f"{report.failures} failure(s)" in line
    counts = [int(n) for n in re.findall(r"(\d+)x \(mean", line)]
    assert sum(counts) == report.failures


def test_a_few_failures_keep_a_row_each(tmp_path: Path) -> None:
    write_stream(tmp_path, StreamShape(steps=200, failures=3, seed=1, ckpt_every=50, repair_after=5))
    report, _ = analyse(tmp_path, plot=False)
    assert 0 < report.failures <= LIST_EACH_UP_TO
    text = _table_text(report)
    assert len(re.findall(r"failure \d+.*: (live|restart|-) recovery", text)) == report.failures
    assert "longest:" not in text
