"""Goodput accounting: an append-only event recorder and an offline calculator.

`GoodputRecorder` appends events to `goodput.jsonl`; `compute_goodput` turns the events of
any number of process lifetimes into a `GoodputReport`; `ntp-goodput RUN_DIR`
(`ntp_nemo.goodput.report`) prints the breakdown and draws the timeline.
"""

from ntp_nemo.goodput import events
from ntp_nemo.goodput.calculator import (
    Failure,
    GoodputReport,
    Span,
    StepRun,
    Timeline,
    breakdown,
    build_timeline,
    compute_goodput,
    load_events,
    summary_line,
)
from ntp_nemo.goodput.events import BADPUT_CATEGORIES, GOODPUT_FILENAME
from ntp_nemo.goodput.recorder import GoodputRecorder, goodput_path

__all__ = [
    "BADPUT_CATEGORIES",
    "GOODPUT_FILENAME",
    "Failure",
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
    "summary_line",
]
