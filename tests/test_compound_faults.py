"""Faults on top of faults: a relaunch after a live fallback, a failed rejoin, a stop during a rejoin."""

from __future__ import annotations

import gc
import signal
from types import SimpleNamespace

import pytest

from ntp_nemo.resilience.live_training import LiveLauncher


def _collect_garbage_bounded() -> None:
    """A worker's garbage collection; SIGALRM (default action: terminate) bounds a destructor that hangs."""
    signal.alarm(20)
    gc.collect()
    signal.alarm(0)


def test_a_relaunch_never_destroys_an_earlier_attempts_store_in_a_worker():
    """An attempt's launcher hosts the job's TCPStore here; when that attempt is over and its objects sit
    in an unreachable reference cycle (as a finished trainer does), the next attempt's workers must not
    be the ones to destroy it: in a forked child the store's server thread does not exist and the
    destructor's join never returns (the relaunch after a live fallback hung forever)."""
    strategy = SimpleNamespace(num_processes=1)
    gc.disable()  # the cycle below stays uncollected until someone collects it on purpose
    try:
        first = LiveLauncher(strategy)
        first.launch(lambda: None)
        assert first.store is not None  # the attempt's store, hosted in this process
        first.cycle = first  # unreachable once `first` goes: collected only by a garbage collection
        del first
        second = LiveLauncher(strategy)
        second.launch(_collect_garbage_bounded)  # raises ProcessExitedException (-14) if the child hung
        assert [p.exitcode for p in second.procs] == [0]
        second.close()
        assert second.store is None
    finally:
        gc.enable()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
