"""`ComputeTimer`: how long this rank spends computing its share of a step, not waiting for its peers.
The window is the step's micro-batch phase (`train_step`'s `microbatches`: every forward and backward of
this replica's micro-batches), from its start to the moment the rank is ready for the step's data-parallel
collectives; the waits for slower peers at the step's end come after it (the gradient sync, the fused
scalars).  Inside the window a TP rank also exchanges with its TP peers in every layer: on a CPU runtime
its TP groups (`ntpdirect`, `DirectGroup.watch`) report each exchange, and the time in them (the
transfer and the wait for a slower peer) is not counted.  On a CPU runtime the figure is the calling
thread's CPU time (a CPU rank computes on that thread: one intra-op thread), which the other processes
sharing the cores do not change (on this 2-core machine a rank's wall time in the phase ran at 1.8
times its CPU time beside a test run); a CPU starved by other processes is not seen as slow by it.  On
a GPU the phase only queues kernels, so a pair of CUDA events brackets it and is read at
the next step, when the step's one host read has completed them (the figure then lags one step; nothing
waits for the device in the hot path).

`slowdown` makes the rank behave as a slower device (the `slow` fault's `factor`): it sleeps
`(1/factor - 1)` times the work it did, inside the window, so the figure it reports is the slow
device's.  On a CPU runtime the work is the calling thread's CPU time (a CPU rank computes on that
thread: one intra-op thread), not its wall time, which also holds the time other processes had the
cores; and the sleep falls where a slow device's time would: before each exchange of its TP groups, for
the work since the previous one, and at the phase's end for the rest.  A slow device's TP peers then
wait for it inside every layer, in proportion to its own share of the layer, so that weighting the shards
by speed (`fault.straggler_shards`) shortens the step as it would on the device; one sleep at the phase's
end would not (the peers' larger shares would only be added to it).  A rank without such groups (TP 1,
`ntp.cpu_tp_backend=gloo`) sleeps at the phase's end for the whole phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

MEASURED_PHASE = "microbatches"
MIN_SLEEP_S = 1e-3  # a slowed device sleeps before an exchange once it owes this much (`ComputeTimer._owe`)


class ComputeTimer:
    """Times `train_step`'s micro-batch phase (`phase` is the step's `phase=` argument)."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device or "cpu")
        self.factor = 1.0  # the speed this rank computes at (`slow` fault); 1: its own
        self.last_s = 0.0  # the last completed measurement, seconds
        self.own_cpu_s = 0.0  # CPU seconds this timer spent on itself (its bookkeeping, not the phase)
        self._events: tuple | None = None  # CUDA: the events of the last phase, read at the next one
        self._watched: list[Any] = []  # the TP groups that report their exchanges (`watch`)
        self._mark: float | None = None  # in the phase: thread CPU time up to which the work is accounted
        self._entered: float | None = None  # when the exchange under way began
        self._exchanged = 0.0  # CPU seconds of the phase spent in exchanges of watched groups
        self._slept = 0.0  # seconds a slowed device's work took beyond this one's in the phase (its sleeps)
        self._owed = 0.0  # a slowed device's sleep owed and not slept yet (negative: overslept)

    def slowdown(self, factor: float) -> None:
        """From the next step on, compute at `factor` of this device's speed (1: its own speed)."""
        self.factor = float(factor)

    def watch(self, groups: list[Any]) -> None:
        """Be told of the exchanges of `groups` (this rank's TP process groups on the running layout; those
        without a `watch` slot are passed over); the groups watched before are let go."""
        groups = [g for g in groups if hasattr(g, "watch")]
        if groups == self._watched:
            return
        for g in self._watched:
            if g.watch is self:
                g.watch = None
        for g in groups:
            g.watch = self
        self._watched = groups

    def before_exchange(self) -> None:
        """An exchange of a watched group starts: a slowed device first sleeps for its work since the
        last mark (inside the measured phase only)."""
        if self._mark is None:
            return
        if self.factor < 1.0 and self.device.type != "cuda":
            self._owe(time.thread_time() - self._mark, MIN_SLEEP_S)
        self._entered = time.thread_time()

    def _owe(self, work_s: float, at_least_s: float) -> float:
        """Add the sleep a slow device owes for `work_s` of work and sleep what is owed once it reaches
        `at_least_s`; returns the seconds slept.  What a sleep overshoots (a wake-up is late by tens of
        microseconds) is taken off what is owed next, up to `MIN_SLEEP_S`: over a step the device sleeps
        what it owes, though a TINY layer's segments are shorter than a wake-up's delay, and a wake-up
        late by more (the host was busy) is not paid back.  The figure the timer reports counts what is
        owed, not what the sleeps came to."""
        owed = work_s * (1.0 / self.factor - 1.0)
        self._slept += owed  # the slow device's time, whatever the host's sleeps come to
        self._owed += owed
        if self._owed < at_least_s or self._owed <= 0.0:
            return 0.0
        t = time.perf_counter()
        time.sleep(self._owed)
        slept = time.perf_counter() - t
        # a wake-up late by more than a threshold's worth is the host's (a loaded machine), not owed back
        self._owed = max(self._owed - slept, -MIN_SLEEP_S)
        return slept

    def after_exchange(self) -> None:
        if self._mark is None or self._entered is None:
            return
        self._mark = time.thread_time()  # the exchange's own CPU (copies, polling) is not the device's work
        self._exchanged += self._mark - self._entered
        self._entered = None

    def _cuda_reading(self) -> float | None:
        if self._events is None:
            return None
        start, end = self._events
        return start.elapsed_time(end) / 1000.0 if end.query() else None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name != MEASURED_PHASE:
            yield
            return
        c0 = time.process_time()
        cuda = self.device.type == "cuda"
        if cuda:
            done = self._cuda_reading()
            if done is not None:
                self.last_s = done
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        w0 = time.thread_time()
        self._mark, self._exchanged, self._entered, self._slept = w0, 0.0, None, 0.0
        c1 = time.process_time()
        try:
            yield
        finally:
            mark, self._mark = self._mark, None
        c2 = time.process_time()
        # CPU: the thread's CPU time outside the TP exchanges, and a slowed device's sleeps
        took = time.thread_time() - w0 - self._exchanged
        if self.factor < 1.0:
            # CUDA: the host saw only the kernels' launch; stretch by the last device reading instead.
            # CPU: this thread's own work since the last paced exchange, not its waits (module docstring).
            if cuda:
                extra = self.last_s * (1.0 - self.factor)  # (1/f - 1) times the device's own time
                torch.cuda._sleep(int(extra * 1.4e9))  # device cycles at roughly 1.4 GHz
            else:
                self._owe(time.thread_time() - mark, 0.0)
        took += self._slept
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (start, end)
        else:
            self.last_s = took
        self.own_cpu_s += (c1 - c0) + (time.process_time() - c2)

    def reading(self, device: torch.device | str) -> torch.Tensor:
        """The last measurement as a 0-dim float64 tensor on `device` (for the step's fused scalars)."""
        return torch.tensor(self.last_s, dtype=torch.float64).to(device, non_blocking=True)


__all__ = ["MEASURED_PHASE", "ComputeTimer"]
