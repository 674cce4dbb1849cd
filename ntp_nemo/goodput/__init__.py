"""Goodput accounting: an append-only event recorder and an offline calculator.

`GoodputRecorder` appends events to `goodput.jsonl`; `compute_goodput` turns the events of
any number of process lifetimes into a `GoodputReport`; `GoodputCalculator` does the same one event at a
time (the running figures, the dashboard; `replay_file` feeds it a run's file); `ntp-goodput RUN_DIR`
(`ntp_nemo.goodput.report`) prints the breakdown and draws the timeline.
"""

from ntp_nemo.goodput import events
from ntp_nemo.goodput.calculator import (
    Failure,
    GoodputCalculator,
    GoodputReport,
    Span,
    StepRun,
    Timeline,
    breakdown,
    build_timeline,
    compute_goodput,
    load_events,
    replay_file,
    summary_line,
)
from ntp_nemo.goodput.events import BADPUT_CATEGORIES, GOODPUT_FILENAME
from ntp_nemo.goodput.recorder import GoodputRecorder, goodput_path

__all__ = [
    "BADPUT_CATEGORIES",
    "GOODPUT_FILENAME",
    "Failure",
    "GoodputCalculator",
    "GoodputRecorder",
    "GoodputReport",
    "Span",
    "StepRun",
    "Timeline",
    "breakdown",
    "build_timeline",
    "compute_goodput",
    "events",
    "goodput_path",
    "load_events",
    "replay_file",
    "summary_line",
]
