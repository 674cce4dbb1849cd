"""Waiting in tests on the thing itself (a file appears, a step starts, a process reaches a state), never for
a fixed time: `wait_until` polls a condition and fails, naming what it waited for, after a bound.

A fixed `time.sleep` stays only where the time is the point (a hang, a slow client, a window in which
nothing may happen, the gap between two Ctrl-Cs)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, poll_s: float = 0.02,
               alive: Callable[[], object] | None = None, detail: Callable[[], str] | None = None) -> T:
    """Poll `cond()` every `poll_s` seconds until it returns something true, and return that.

    Fails (AssertionError naming `what`) after `timeout_s`, or as soon as `alive()` returns something false
    (what is waited for can no longer happen: the process that would make it exited). `detail()`: more to
    say in the failure (a process's output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        gone = alive is not None and not alive()
        if gone or time.monotonic() >= deadline:
            why = "what would make it is gone" if gone else f"not within {timeout_s:g} s"
            more = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"waiting for {what}: {why}{more}")
        time.sleep(poll_s)
