"""tests/waits.py: `wait_until` returns what the condition found, and fails naming what it waited for."""

from __future__ import annotations

import itertools
import time

import pytest

from tests.waits import wait_until


def test_returns_the_conditions_value_once_it_holds():
    calls = itertools.count(1)
    assert wait_until(lambda: (n := next(calls)) >= 3 and n, 5, "the third call", poll_s=0.001) == 3


def test_fails_after_the_bound_naming_what_it_waited_for():
    t = time.monotonic()
    with pytest.raises(AssertionError, match=r"waiting for a file: not within 0.1 s\nits log"):
        wait_until(lambda: False, 0.1, "a file", poll_s=0.01, detail=lambda: "its log")
    assert 0.1 <= time.monotonic() - t < 5


def test_fails_at_once_when_what_would_make_it_is_gone():
    t = time.monotonic()
    with pytest.raises(AssertionError, match="waiting for step 3: what would make it is gone"):
        wait_until(lambda: False, 60, "step 3", alive=lambda: False)
    assert time.monotonic() - t < 5
